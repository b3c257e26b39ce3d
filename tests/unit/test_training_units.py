"""LR schedule values, weight-decay groups, gradient-accumulation equivalence, and the tied
copy's checkpoint state read under its parameter's name."""

import math

import pytest
import torch

from job_config import parse_args
from models import get_model_spec
from models.init_weights import init_weights
from models.llama3 import ModelArgs, Transformer
from training.loss import StepLoss, cross_entropy_sum
from training.optimizer import (
    build_lr_scheduler,
    build_optimizer,
    lr_factor,
    no_decay_patterns,
    param_groups,
)
from training.step import StepSetup, clip_grad_norm_, train_step


def test_lr_schedule_values():
    f = lambda s, kind, ratio=None: lr_factor(s, 100, 10, ratio, kind, 0.1)  # noqa: E731
    assert f(1, "linear") == pytest.approx(1 / 11)  # warmup never starts at zero
    assert f(10, "linear") == pytest.approx(10 / 11)
    assert f(11, "linear") == pytest.approx(0.1 + 0.9 * (1 - 1 / 90))
    assert f(100, "linear") == pytest.approx(0.1)
    assert f(55, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(100, "cosine") == pytest.approx(0.1)
    assert f(100, "sqrt") == pytest.approx(0.1)
    assert f(70, "constant") == 1.0
    # decay_ratio 0.2: flat at 1 until step 80, then linear to the floor at 100.
    assert f(50, "linear", 0.2) == 1.0
    assert f(90, "linear", 0.2) == pytest.approx(0.1 + 0.9 * 0.5)
    # a decay window reaching into warmup (10 + 95 > 100 steps) starts when warmup ends
    assert f(10, "linear", 0.95) == pytest.approx(10 / 11)
    assert f(11, "linear", 0.95) == pytest.approx(f(11, "linear"))


def test_lr_scheduler_drives_the_optimizer():
    p = torch.nn.Parameter(torch.zeros(2))
    cfg = parse_args(["--lr_scheduler.warmup_steps", "2", "--training.steps", "4"])
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, 4)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1 / 3, 2 / 3, 0.5, 0.0])


def _tiny_model(seed=0):
    with torch.device("meta"):
        m = Transformer(
            ModelArgs(
                dim=32,
                n_layers=2,
                n_heads=4,
                n_kv_heads=2,
                vocab_size=64,
                multiple_of=16,
                max_seq_len=16,
            )
        )
    m.to_empty(device="cpu")
    init_weights(m, seed)
    m.init_buffers("cpu")
    return m


def test_no_weight_decay_on_norms_and_embeddings():
    """The default config takes the family's patterns (its ModelSpec.no_decay); a list given
    replaces them."""
    patterns = no_decay_patterns(parse_args([]))
    assert patterns == list(get_model_spec("llama3").no_decay)
    assert no_decay_patterns(parse_args(["--optimizer.no_decay_patterns", "bias"])) == ["bias"]
    assert no_decay_patterns(parse_args(["--optimizer.no_decay_patterns", "[]"])) == []
    m = _tiny_model()
    decay, keep = param_groups([m], 0.1, patterns)
    names = {id(p): n for n, p in m.named_parameters()}
    assert all("norm" in names[id(p)] or "tok_embeddings" in names[id(p)] for p in keep["params"])
    assert {names[id(p)] for p in keep["params"]} >= {"tok_embeddings.weight", "norm.weight"}
    assert keep["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert len(decay["params"]) + len(keep["params"]) == len(list(m.parameters()))


@pytest.mark.parametrize("impl", ["auto", "foreach", "for-loop"])
def test_optimizer_kernels_agree_and_auto_is_fused_on_cpu(impl):
    """`auto` takes torch's fused AdamW on CPU (the faster kernel, see benchmarks/); every
    kernel choice takes the same steps."""
    ref = _tiny_model()
    model = _tiny_model()
    model.load_state_dict(ref.state_dict())
    opts = []
    for m, choice in ((ref, "fused"), (model, impl)):
        cfg = parse_args(["--optimizer.lr", "0.01", "--optimizer.implementation", choice])
        opts.append(build_optimizer([m], cfg.optimizer, "cpu", no_decay_patterns(cfg)))
    assert opts[0].defaults["fused"] and not opts[0].defaults["foreach"]
    assert opts[1].defaults["fused"] == (impl == "auto")
    # seeded: on some draws of the global RNG the kernels' float32 rounding exceeds the bound
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for m, opt in zip((ref, model), opts):
            cross_entropy_sum(m(x[:, :-1]), x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("impl", ["auto", "foreach"])
def test_a_transposed_gradient_steps_like_a_contiguous_one(impl):
    """A gradient with other strides than its parameter (torch.distributed.pipelining's split
    weight backward assigns them: a weight used as `w.mT`) takes the same step as its
    contiguous copy: torch's fused AdamW kernel reads the memory in the parameter's order, so
    the fused optimizer makes gradients contiguous first (`contiguous_grads`)."""
    cfg = parse_args(["--optimizer.lr", "0.1", "--optimizer.implementation", impl])
    grad = torch.randn(2, 4, 3).mT  # [2, 3, 4], column-major
    params = [torch.nn.Parameter(torch.zeros(2, 3, 4)) for _ in range(2)]
    for p, g in zip(params, (grad, grad.contiguous())):
        p.grad = g
        build_optimizer([torch.nn.ParameterList([p])], cfg.optimizer, "cpu", []).step()
    torch.testing.assert_close(params[0], params[1], rtol=0, atol=0)
    assert params[0].abs().min() > 0


def _run_steps(batch_split, steps=3):
    """Trains a tiny model on 8 fixed sequences per step, split into micro-steps."""
    torch.manual_seed(0)
    data = torch.randint(0, 64, (steps, 8, 17))
    m = _tiny_model()
    cfg = parse_args(["--optimizer.lr", "0.01"])
    opt = build_optimizer([m], cfg.optimizer, "cpu", no_decay_patterns(cfg))
    setup = StepSetup(model_parts=[m], loss_fn=StepLoss(cross_entropy_sum))
    losses = []
    for s in range(steps):
        micro = [(c[:, :-1], c[:, 1:], {}) for c in data[s].split(batch_split)]
        losses.append(train_step(setup, micro).item())
        clip_grad_norm_(list(m.parameters()), 1.0)
        opt.step()
        opt.zero_grad()
    return losses, m


def test_gradient_accumulation_4x2_equals_batch_8():
    full, m_full = _run_steps(8)
    accum, m_accum = _run_steps(2)
    assert accum == pytest.approx(full, rel=1e-5)
    for a, b in zip(m_full.parameters(), m_accum.parameters()):
        # 1% of one step's update (lr 0.01): summation order differs between the two, and
        # Adam's division by sqrt(v) enlarges that noise where a gradient is near zero (seen
        # at 1.3e-5 on torch 2.11). A wrong accumulation is off by whole updates.
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_clip_grad_norm_returns_total_norm_and_clips():
    p = torch.nn.Parameter(torch.zeros(4))
    q = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.full((4,), 3.0)
    q.grad = torch.full((3,), 4.0)
    norm = clip_grad_norm_([p, q], 1.0)
    assert norm.item() == pytest.approx(math.sqrt(4 * 9 + 3 * 16))
    total = torch.cat([p.grad, q.grad]).norm()
    assert total.item() == pytest.approx(1.0, rel=1e-5)


def test_autocast_covers_forward_and_loss_but_not_backward():
    from models.llama3 import ModelArgs, Transformer
    from training.loss import StepLoss, cross_entropy_sum
    from training.step import StepSetup, train_step
    from training.trainer import forward_contexts

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    loss_context, autocast = forward_contexts(False, torch.bfloat16, "cpu")
    with loss_context(), autocast():
        assert (a @ b).dtype == torch.bfloat16
    with forward_contexts(False, None, "cpu")[1]():
        assert (a @ b).dtype == torch.float32

    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64, multiple_of=16, max_seq_len=8)
    model = Transformer(args)
    model.init_buffers("cpu")
    seen = {}

    def watch(module, inputs, out):  # logits: bf16 from the forward under autocast
        seen["logits"] = out.dtype
        out.register_hook(lambda g: seen.update(backward=torch.is_autocast_enabled("cpu")))

    model.output.register_forward_hook(watch)
    setup = StepSetup(
        [model], StepLoss(cross_entropy_sum), loss_context=loss_context, autocast=autocast
    )
    x = torch.randint(0, 64, (2, 8))
    train_step(setup, [(x, x, {})])
    assert seen == {"logits": torch.bfloat16, "backward": False}
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_process_group_backend_adds_gloo_for_offloaded_cuda_runs():
    from training.distributed import process_group_backend

    assert process_group_backend("cpu", 2) == process_group_backend("cpu", 2, True) == "gloo"
    assert process_group_backend("cuda", 2) == "nccl"
    # offloaded gradients live on the host: their norm is all-reduced by gloo
    assert process_group_backend("cuda", 2, True) == "cuda:nccl,cpu:gloo"
    # one GPU exchanges nothing between GPUs: no NCCL communicator to set up
    assert process_group_backend("cuda", 1) == "gloo"
    assert process_group_backend("cuda", 1, True) == "gloo"


def test_non_finite_watch_keeps_the_first_bad_step_of_a_loss_holding_rank():
    from training.loop import NonFiniteError, NonFiniteWatch

    one, nan, inf = torch.tensor(1.0), torch.tensor(float("nan")), torch.tensor(float("inf"))
    watch = NonFiniteWatch(torch.device("cpu"))
    watch.note(1, one, one, has_loss=True)
    watch.note(2, nan, one, has_loss=False)  # a pipeline stage before the last: no loss
    watch.check("; unused")  # nothing non-finite yet: no error
    watch.note(3, one, inf, has_loss=False)
    watch.note(4, nan, one, has_loss=True)
    expected = r"^non-finite loss or gradient norm at step 3; not saving a checkpoint\.$"
    with pytest.raises(NonFiniteError, match=expected):
        watch.check("; not saving a checkpoint.")


def test_log_window_record_averages_the_steps_since_the_last_log(tmp_path):
    import json
    from types import SimpleNamespace

    from metrics import MetricsLogger
    from metrics.profiling import PhaseTimer
    from training.loop import LogWindow, TrainState, log_window

    cfg = parse_args(["--compile.enable", "false"])
    metrics = MetricsLogger(str(tmp_path), 0, enable_tensorboard=False, console=False)
    run = SimpleNamespace(
        cfg=cfg,
        device=torch.device("cpu"),
        parallel_dims=SimpleNamespace(world_size=4),
        state=TrainState(step=7, tokens_seen=1000),
        first_step=1,
        loss_replicas=1,
        tokens_per_step=800,  # 200 tokens per device and step
        flops_per_token=1e9,
        peak_flops=1e12,
        phases=PhaseTimer(torch.device("cpu")),
        metrics=metrics,
        window=LogWindow(),
        mtp_loss=None,
    )
    run.window.add(3.0, 0.5)
    run.window.add(1.0, 0.25)
    record = log_window(run, torch.tensor(2.5), torch.tensor(0.75), 1e-3)
    metrics.close()
    assert (record["loss"], record["grad_norm"], record["lr"]) == (2.5, 0.75, 1e-3)
    assert record["step_time_s"] == 2.0 and record["data_time_s"] == 0.375
    assert record["tokens_per_sec"] == 100.0  # 2 x 200 tokens in 4 s
    assert record["mfu"] == pytest.approx(10.0) and record["tokens_seen"] == 1000
    assert "compile_time_s" not in record and run.window == LogWindow()
    (written,) = [
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert written["step"] == 7 and written["kind"] == "train" and written["loss"] == 2.5


def test_close_run_keeps_the_training_error_when_the_checkpointer_fails_to_close(caplog):
    from types import SimpleNamespace

    from training.loop import close_run

    closed = []

    def closer(name, error=None):
        def close():
            closed.append(name)
            if error is not None:
                raise error

        return SimpleNamespace(close=close)

    def run(checkpoint_error):
        return SimpleNamespace(
            profiler=closer("profiler"),
            snapshot=closer("snapshot"),
            checkpointer=closer("checkpointer", checkpoint_error),
            metrics=closer("metrics"),
        )

    with caplog.at_level("ERROR", logger="meshtrain"):
        close_run(run(OSError("disk gone")), failed=True)
    assert closed == ["profiler", "snapshot", "checkpointer", "metrics"]
    assert "checkpoint: closing after the error also failed: disk gone" in caplog.text
    with pytest.raises(OSError, match="disk gone"):  # no training error to keep: this one
        close_run(run(OSError("disk gone")), failed=False)


def test_step_error_names_rank_step_and_the_timeout_setting():
    from types import SimpleNamespace

    from training.loop import TrainState, step_error

    cfg = parse_args(["--comm.train_timeout_seconds", "42"])
    run = SimpleNamespace(rank=1, state=TrainState(step=5), cfg=cfg)
    assert str(step_error(run, ValueError("bad shape"))) == (
        "rank 1 failed at step 5: ValueError: bad shape"
    )
    assert str(step_error(run, RuntimeError("Socket Timeout"))) == (
        "rank 1 failed at step 5: RuntimeError: Socket Timeout (comm.train_timeout_seconds = 42)"
    )


def test_validation_steps_are_whole_global_batches_whatever_the_split():
    from training.validate import global_batches

    def read(micro_batches, steps, batches=7):
        return [list(g) for g in global_batches(range(batches), micro_batches, steps)]

    # one global batch = 2 loader batches (accumulation 2): 3 whole ones of 7 batches, the
    # seventh (half a global batch) left out, so 1 x 6 and 2 x 3 read the same sequences
    assert read(2, -1) == [[0, 1], [2, 3], [4, 5]]
    assert read(1, -1, batches=6) == [[0], [1], [2], [3], [4], [5]]
    assert read(2, 2) == [[0, 1], [2, 3]]
    assert read(3, 5) == [[0, 1, 2], [3, 4, 5]]
    assert read(2, 0) == []


def test_tied_copy_reads_what_a_one_parameter_layout_saved():
    """A layout that keeps one tied parameter saves its optimizer state under the parameter's
    name only; the copy a pipeline stage holds reads it from there (`tied_aliases`), whether
    this rank holds the parameter too (copied after the load) or not (read under its name)."""
    from checkpoint.state import reading_aliases, tied_aliases

    tied = {"output.weight": "tok_embeddings.weight"}
    metadata = {f"optimizer.state.tok_embeddings.weight.{k}": None for k in ("exp_avg", "step")}
    metadata |= {"model.output.weight": None, "model.tok_embeddings.weight": None}
    last_stage = {"model": {"output.weight": torch.zeros(2)},
                  "optimizer": {"state.output.weight.exp_avg": torch.zeros(2)}}  # fmt: skip
    aliases = tied_aliases(last_stage, metadata, tied)
    assert aliases == [("optimizer", "state.output.weight.exp_avg",
                        "state.tok_embeddings.weight.exp_avg")]  # fmt: skip
    with reading_aliases(last_stage, aliases):
        assert list(last_stage["optimizer"]) == ["state.tok_embeddings.weight.exp_avg"]
        last_stage["optimizer"]["state.tok_embeddings.weight.exp_avg"].fill_(3.0)  # the load
    assert last_stage["optimizer"]["state.output.weight.exp_avg"].tolist() == [3.0, 3.0]

    both = {"optimizer": {"state.tok_embeddings.weight.exp_avg": torch.zeros(2),
                          "state.output.weight.exp_avg": torch.zeros(2)}}  # fmt: skip
    aliases = tied_aliases(both, metadata, tied)
    with reading_aliases(both, aliases):
        both["optimizer"]["state.tok_embeddings.weight.exp_avg"].fill_(5.0)
    assert both["optimizer"]["state.output.weight.exp_avg"].tolist() == [5.0, 5.0]
    assert (
        tied_aliases(both, {**metadata, "optimizer.state.output.weight.exp_avg": None}, tied) == []
    )
