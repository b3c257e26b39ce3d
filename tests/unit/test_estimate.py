"""Scale planning: the estimator's numbers against real tensors, real saved activations and
real collectives of the same code, and the CLIs at 8B-405B scale (all in-process, on CPU)."""

import contextlib
import dataclasses
import importlib.util
import io
import re
import time

import pytest
import torch
from dist_utils import TINY_SHAPE, fake_world
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

from job_config import parse_args
from metrics.memory_report import memory_report
from models import arg_overrides, build_model_args, get_model_spec, model_args_for
from models.init_weights import materialize
from parallelisms.decoder import AssemblyConfig, parallelize_decoder
from parallelisms.parallel_dims import ParallelDims
from planning.advise import Workload, advise, analytic_activations, analytic_memory, fits
from planning.communication import (
    Cluster,
    Experts,
    Layout,
    all_to_all_bytes,
    comm_per_step,
    kv_all_gather_bytes,
    ulysses_all_to_all_bytes,
)
from planning.memory import (
    GIB,
    attention_bytes,
    block_mask_bytes,
    korthikanti_layer_bytes,
    rank_activations,
    zero_bytes_per_param,
)
from planning.simulate import count_experts, gathered_elements, on_ep_mesh, simulate
from training.loss import cross_entropy_sum
from training.optimizer import build_optimizer, no_decay_patterns

TINY = " ".join(TINY_SHAPE) + " --training.seq_len 32 --training.local_batch_size 2"


def _script():
    spec = importlib.util.spec_from_file_location("estimate_cli", "scripts/estimate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cfg(extra: str = ""):
    return parse_args((TINY + " " + extra).split())


def _args(cfg):
    return build_model_args(cfg.model.name, cfg.model.flavor, 32, None, arg_overrides(cfg))


class CommCounter(TorchDispatchMode):
    """Bytes each rank sends per collective as dispatched: c10d ops (FSDP's all-gathers and
    reduce-scatters) and functional collectives (DTensor's TP redistributions), ring costs."""

    def __init__(self):
        super().__init__()
        self.sent = {"c10d": 0.0, "functional": 0.0, "all_reduce": 0.0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name.startswith("c10d.") and ("allgather_base" in name or "reduce_scatter" in name):
            big, small = sorted((args[0], args[1]), key=lambda t: -t.numel())
            n = big.numel() // small.numel()
            self.sent["c10d"] += (n - 1) / n * big.nbytes
        elif name.startswith("_c10d_functional.all_gather_into_tensor"):
            n = args[1]
            self.sent["functional"] += (n - 1) * args[0].nbytes
        elif name.startswith("_c10d_functional.reduce_scatter_tensor"):
            n = args[2]
            self.sent["functional"] += (n - 1) / n * args[0].nbytes
        elif "all_reduce" in name or "allreduce" in name:
            self.sent["all_reduce"] += sum(a.nbytes for a in args if isinstance(a, torch.Tensor))
        return out


def _real_step(cfg, world: int, tp: int, zero: int, counter: CommCounter | None = None):
    """One real forward/backward/AdamW step of the parallelized tiny model on CPU (fake group:
    collectives move no data but have their real sizes); returns memory_report's bytes."""
    spec = get_model_spec(cfg.model.name)
    with fake_world(world):
        dims = ParallelDims.from_config(
            world_size=world, dp_replicate=1, dp_shard=-1, tp=tp, pp=1, zero_stage=zero
        )
        dims.build_mesh("cpu")
        with torch.device("meta"):
            model = spec.model_cls(_args(cfg))
        model = parallelize_decoder(model, spec, dims, AssemblyConfig.of(cfg), "cpu")
        model = materialize(model, 0, "cpu")
        opt = build_optimizer([model], cfg.optimizer, "cpu", no_decay_patterns(cfg))
        tokens, labels = torch.randint(0, 4096, (2, 32)), torch.randint(0, 4096, (2, 32))
        with counter if counter is not None else contextlib.nullcontext():
            with loss_parallel() if tp > 1 else contextlib.nullcontext():
                cross_entropy_sum(model(tokens), labels).backward()
        opt.step()
        return memory_report([model], opt)


QWEN3_TIED = "--model.name qwen3 --model.flavor debugmodel"
QWEN3_UNTIED = "--model.name qwen3 --model.flavor debugmodel_untied"


@pytest.mark.parametrize(
    "world,tp,zero,model",
    [
        (2, 1, 0, ""),
        (2, 1, 1, ""),
        (2, 1, 2, ""),
        (2, 1, 3, ""),
        (4, 2, 3, ""),
        (4, 2, 0, ""),
        (4, 2, 1, ""),
        (4, 2, 2, ""),
        (4, 2, 3, QWEN3_TIED),
        (2, 1, 3, QWEN3_TIED),
        (2, 1, 2, QWEN3_UNTIED),
    ],
)
def test_simulated_states_equal_real_tensors_after_a_step(world, tp, zero, model):
    cfg = _cfg(f"--parallelism.tensor_parallel_degree {tp} --parallelism.zero_stage {zero} {model}")
    plan = simulate(get_model_spec(cfg.model.name), _args(cfg), cfg, world, device_type="cpu")
    rank = plan.ranks[0]
    real = _real_step(cfg, world, tp, zero)
    extra = 0
    if tp > 1 and zero == 0:
        # Known, not modelled: under DDP the TP embedding's gradient comes back Replicate
        # (the full vocab x dim on every TP rank) while its weight is Shard(0) (FSDP and
        # ZeRO-1/2 take their weight's placement from it before reducing).
        extra = 4096 * 64 * 4 // 2
    assert (rank.params, rank.grads + extra, rank.optimizer) == (
        real.params,
        real.grads,
        real.optimizer,
    )


def _saved_bytes(block: torch.nn.Module, x: torch.Tensor, skip: set[int], *inputs) -> int:
    """Bytes of the tensors autograd saves for backward in one block's forward."""
    saved = {}

    def pack(t):
        if isinstance(t, AsyncCollectiveTensor):  # a gathered K/V (CP), saved as it came
            t = t.elem
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, *inputs)
    return sum(saved.values())


@pytest.mark.parametrize(
    "name,flavor,shape",
    [
        ("llama3", "debugmodel", {"dim": 256, "n_heads": 8}),
        ("llama3", "debugmodel", {"dim": 256, "n_heads": 8, "n_kv_heads": 2}),  # 4 per group
        ("qwen3", "debugmodel", {"dim": 256, "n_heads": 8, "n_kv_heads": 4}),
        ("qwen3", "debugmodel_untied", {"dim": 128, "n_heads": 4, "n_kv_heads": 1}),
        ("qwen3_moe", "debugmodel", {}),
        ("qwen3_moe", "debugmodel", {"n_experts": 16, "top_k": 4, "moe_ffn_dim": 96}),
        ("gemma2", "debugmodel", {}),
        ("gemma2", "debugmodel", {"dim": 128, "n_heads": 8, "n_kv_heads": 2}),
        ("gemma3", "debugmodel", {"dim": 256, "n_heads": 8, "n_kv_heads": 4}),
        ("gemma3", "debugmodel", {"dim": 128, "n_heads": 4, "n_kv_heads": 1}),
        ("gpt_oss", "debugmodel", {}),
        ("gpt_oss", "debugmodel", {"n_experts": 16, "top_k": 2, "moe_ffn_dim": 96}),
    ],
)
def test_family_block_count_equals_saved_activations_on_cpu(name, flavor, shape):
    """Each family's per-layer activation count against the bytes autograd really saves
    (bf16, training mode), within 5%; Qwen3's q/k/v width (n_heads x head_dim) is not its
    dim; Qwen3-MoE's experts see top_k copies of every token (dropless: whatever the routing);
    Gemma 2's block (a sliding, soft-capped layer) gets its block mask as the decoder builds
    it, and its attention core keeps no scores."""
    from models.attention import attention_batch

    spec = get_model_spec(name)
    s, b = 128, 2
    args = build_model_args(name, flavor, s, None, shape)
    model = spec.model_cls(args).to(torch.bfloat16)
    model.init_buffers("cpu")
    with torch.no_grad():  # defined values: the MoE router's choices are read from them
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip.add(model.rope.untyped_storage().data_ptr())
    x = torch.randn(b, s, args.dim, dtype=torch.bfloat16, requires_grad=True)
    batch = attention_batch(model.attention_specs, b, s, x.device)  # None: plain causal
    measured = _saved_bytes(model.layers["0"], x, skip, model.rope, batch)
    assert spec.block_activation_bytes(args, s, b, 1) == pytest.approx(measured, rel=0.05)


def test_korthikanti_reference_counts():
    # Korthikanti's GPT count, for reference: sbh(34 + 5as/h), and its TP/AC variants
    assert korthikanti_layer_bytes(8, 1, 4, 2) == 8 * 4 * (34 + 5 * 2 * 8 / 4)
    assert korthikanti_layer_bytes(8, 1, 4, 2, 2) == 8 * 4 * (17 + 5 * 2 * 8 / 8)
    assert korthikanti_layer_bytes(8, 1, 4, 2, 2, recompute="full") == 2 * 8 * 4 / 2


QWEN3_MOE = "--model.name qwen3_moe --model.flavor debugmodel"


@pytest.mark.parametrize(
    "tp,model,ac",
    [(1, "", "none"), (2, "", "none"), (1, QWEN3_MOE, "none"), (2, QWEN3_MOE, "full")],
)
def test_comm_model_equals_counted_collectives(tp, model, ac):
    """FSDP and TP+SP bytes against a real step's collectives. Qwen3-MoE (no EP): its experts
    travel whole with each block's FSDP gathers on every TP rank (TP does not split them),
    and each MoE layer runs 2 TP collectives fewer each way than a dense feed-forward."""
    cfg = _cfg(
        f"--parallelism.tensor_parallel_degree {tp} {model} --activation_checkpoint.mode {ac}"
    )
    world = 2 * tp  # dp 2 x tp
    counter = CommCounter()
    _real_step(cfg, world, tp, 3, counter)
    args = _args(cfg)
    with torch.device("meta"):
        meta = get_model_spec(cfg.model.name).model_cls(args)
    n = sum(p.numel() for p in meta.parameters())
    experts = None
    if model:
        expert_params = sum(p.numel() for k, p in meta.named_parameters() if ".experts." in k)
        experts = Experts(args.n_experts, args.top_k, args.n_layers, expert_params)
    comms = comm_per_step(
        args,
        n,
        Layout(tp=tp, pp=1, dp=2, ac=ac),
        Cluster(),
        seq_len=32,
        local_batch=2,
        param_bytes=4,
        reduce_bytes=4,
        experts=experts,
    )
    by = {c.dim: c.bytes for c in comms}
    # not modelled: parameters TP replicates (norms, the router) count as TP-split (< 0.2%)
    assert by["dp"] == pytest.approx(counter.sent["c10d"], rel=2e-3 if model else 1e-3)
    if tp > 1:
        assert by["tp"] == pytest.approx(counter.sent["functional"], rel=1e-3)
        # not modelled: TP all-reduces of norm-weight gradients and loss-parallel statistics
        assert counter.sent["all_reduce"] < 0.02 * by["tp"]


def test_exercise_1_arithmetic_and_real_apply_functions():
    cli = _script()
    assert [zero_bytes_per_param(s, 8)[0] for s in range(4)] == [16, 5.5, 3.75, 2]
    text = cli.exercise_1()
    assert "DDP             2 + 2 + 12 = 16   208.3 GB" in text
    assert (
        "ZeRO-3   params    6.1 + grads    6.1 + AdamW   12.1 =   24.2 GiB (2.00 B/param)" in text
    )


def test_scale_cli_405b_on_2048_ranks_and_train_dry_run(capsys):
    cli = _script()
    t0 = time.perf_counter()
    assert cli.main(["--config", "llama3_405b", "--world-size", "2048"]) == 0
    out = capsys.readouterr().out
    assert time.perf_counter() - t0 < 60
    assert "world=2048 pp=8 dp_replicate=1 dp_shard=32 tp=8" in out
    assert out.count(" fits") == 3  # first, second and last pipeline stage

    from training.launch import run

    assert run(["--config", "llama3_8b", "--job.dry_run", "--job.simulate_world_size", "8"]) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248" in out and "dp_shard=8" in out
    assert "     0     0     32      3.74      3.74      7.48" in out  # 16 B/param / 8


def test_advise_proposes_tp_inside_nodes_and_fsdp_across():
    cli = _script()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["--exercise", "2"]) == 0
    text = out.getvalue()
    assert "Proposed: TP 8 x PP 1 x FSDP 8" in text
    assert "tp (8 ranks over NVLink)" in text and "dp (8 ranks over network)" in text
    assert "Checked with the real parallelize functions" in text


@pytest.mark.parametrize("preset", ["llama3_8b", "llama3_70b", "llama3_405b"])
def test_advise_checks_its_proposal_for_every_preset(preset):
    """The proposal is checked under the preset's other options: a preset's PP schedule or
    per-op AC option must not make the check config invalid when the proposal turns PP or AC
    off (it once did: exit 2, no table)."""
    cli = _script()
    out = io.StringIO()
    args = ["--advise", "--config", preset, "--gpus-per-node", "8", "--nodes", "64"]
    with contextlib.redirect_stdout(out):
        assert cli.main([*args, "--device-memory-gib", "80"]) == 0
    assert "Checked with the real parallelize functions" in out.getvalue()


def test_fsdp_buffer_of_llama3_8b_at_tp2_fsdp4_by_hand():
    """FSDP2 over TP-sharded weights places the column-sharded ones (wq, wk, wv, w1, w3, the
    vocab-sharded embedding and output) `_StridedShard` on the dp dim: they count as sharded."""
    cfg = parse_args("--config llama3_8b --parallelism.tensor_parallel_degree 2".split())
    spec = get_model_spec("llama3")
    args = model_args_for(cfg, cfg.training.seq_len)
    rank = simulate(spec, args, cfg, 8, device_type="cuda", ranks=[0]).ranks[0]
    h, kv, f, v, tp = 4096, 1024, 14336, 128256, 2
    matrices = h * (h + kv + kv + h) + 3 * h * f  # all TP-sharded
    block = matrices // tp + 2 * h  # 109,060,096 elements per rank, the norms replicated
    head = v * h // tp + h  # output (vocab-sharded) + final norm: 262,672,384
    bf16, fp32 = 2, 4
    # the head unit gathered with its unsharded gradients (bf16 + fp32), beside the last block
    expected = head * (2 * bf16 + fp32) + block * bf16
    assert expected == 2_319_499_264  # 2.16 GiB; 0.59 GiB when _StridedShard was not counted
    assert rank.working == expected


def test_gathered_elements_equal_fsdp_unsharded_parameters_under_tp():
    """The estimator's gathered size of each FSDP unit equals what FSDP's unshard really holds
    per rank at TP 2 x FSDP 2 (fake group: the all-gathers have their real sizes)."""
    cfg = _cfg("--parallelism.tensor_parallel_degree 2")
    spec = get_model_spec("llama3")
    with fake_world(4):
        dims = ParallelDims.from_config(
            world_size=4, dp_replicate=1, dp_shard=-1, tp=2, pp=1, zero_stage=3
        )
        dims.build_mesh("cpu")
        with torch.device("meta"):
            model = spec.model_cls(_args(cfg))
        model = parallelize_decoder(model, spec, dims, AssemblyConfig.of(cfg), "cpu")
        model.to_empty(device="cpu")
        # the case this checks is present: FSDP's dp placement of the column-sharded weights
        assert any(isinstance(p.placements[0], _StridedShard) for p in model.parameters())
        units = [
            [model.tok_embeddings],
            [model.norm, model.output],
            *[[b] for b in model.layers.values()],
        ]
        for unit in units:
            estimated = sum(gathered_elements(m) for m in unit)
            unit[-1].unshard()  # norm and output are one FSDP group: one unshard gathers both
            real = sum(p.to_local().numel() for m in unit for p in m.parameters())
            assert not any(
                "dp" in str(p.device_mesh.mesh_dim_names) for m in unit for p in m.parameters()
            )
            assert real == estimated, unit
            unit[-1].reshard()


# ------------------------------------------------------------------------ mixture of experts
def _moe_cfg(extra: str = ""):
    return parse_args(f"--config debug_model {QWEN3_MOE} {extra}".split())


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2), (8, 4)])
def test_simulated_expert_bytes_fall_by_the_ep_degree(world, ep):
    """Qwen3-MoE debugmodel (4 layers x 8 experts of three [128, 256] matrices): each rank
    gathers 1/ep of a layer's experts (its EP share, over the world / ep ranks outside EP), and
    holds 1/ep of all experts when EP is all there is (world = ep); FSDP shards the rest."""
    cfg = _moe_cfg(f"--parallelism.expert_parallel_degree {ep}")
    spec = get_model_spec("qwen3_moe")
    rank = simulate(spec, _args(cfg), cfg, world, device_type="cpu", ranks=[0]).ranks[0]
    one_layer = 3 * 8 * 128 * 256  # w1, w2, w3 of the 8 experts
    assert rank.expert_gathered == one_layer // ep
    fp32 = 4
    assert rank.expert_bytes == 4 * one_layer * fp32 // world  # EP x FSDP = every shard rank
    if world == ep:
        assert rank.expert_bytes == 4 * one_layer * fp32 // ep


def test_simulated_params_of_a_qwen3_moe_ep_layout_equal_the_shapes():
    """TP 2 x FSDP 2 with EP 2 (world 4; no rank left outside EP): attention and the vocabulary
    are split by TP and FSDP, the norms and the router (replicated over TP) by FSDP only, the
    experts by EP only, none by TP (fp32 parameters on CPU)."""
    cfg = _moe_cfg("--parallelism.tensor_parallel_degree 2 --parallelism.expert_parallel_degree 2")
    spec = get_model_spec("qwen3_moe")
    rank = simulate(spec, _args(cfg), cfg, 4, device_type="cpu", ranks=[0]).ranks[0]
    dim, vocab, layers, q, kv, head_dim = 256, 4096, 4, 4 * 32, 2 * 32, 32
    tp_split = 2 * vocab * dim + layers * (dim * q + 2 * dim * kv + q * dim)
    replicated = dim + layers * (2 * dim + 2 * head_dim + 8 * dim)  # norms, q/k norms, router
    experts = layers * 3 * 8 * 128 * dim
    local = tp_split // 4 + replicated // 2 + experts // 2
    assert local == 2_200_832
    assert (rank.local_params, rank.params) == (local, 4 * local)
    assert rank.expert_bytes == 4 * experts // 2


def test_gathered_experts_equal_fsdp_unshard_under_ep():
    """The estimator's gathered size of an experts unit equals what FSDP's unshard holds per
    rank at EP 2 x FSDP 2 (gathered over the 2 ranks outside EP, not all 4 shard ranks)."""
    cfg = _moe_cfg("--parallelism.expert_parallel_degree 2")
    spec = get_model_spec("qwen3_moe")
    with fake_world(4):
        dims = ParallelDims.from_config(
            world_size=4, dp_replicate=1, dp_shard=-1, tp=1, pp=1, zero_stage=3, ep=2
        )
        dims.build_mesh("cpu")
        with torch.device("meta"):
            model = spec.model_cls(_args(cfg))
        model = parallelize_decoder(model, spec, dims, AssemblyConfig.of(cfg), "cpu")
        model.to_empty(device="cpu")
        experts = model.layers["0"].moe.experts
        assert all(on_ep_mesh(p) for p in experts.parameters())
        estimated = gathered_elements(experts)
        experts.unshard()
        real = sum(p.to_local().numel() for p in experts.parameters())
        experts.reshard()
    assert real == estimated == 3 * 4 * 128 * 256  # 4 of the 8 experts


def test_all_to_all_volume_by_hand():
    """235B-A22B shapes, 4096 tokens per micro-batch on EP 8: per MoE layer 4 all-to-alls
    (dispatch + combine, forward + backward) of 4096 x 8 rows x 4096 x 2 B = 256 MiB, 7/8 of
    them leave the rank: 4 x 94 x 256 MiB x 7/8 = 88,315,265,024 B; full AC adds a third pass
    (6 instead of 4)."""
    assert all_to_all_bytes(4096, 8, 4096, 8, 94, 2, recompute=False) == 88_315_265_024
    assert all_to_all_bytes(4096, 8, 4096, 8, 94, 2, recompute=True) == 132_472_897_536
    assert all_to_all_bytes(4096, 8, 4096, 1, 94, 2, recompute=False) == 0
    args = build_model_args("qwen3_moe", "235B-A22B", 4096)
    experts = Experts(128, 8, 94, 227_096_395_776)
    cluster = Cluster()
    for tp, link, bandwidth in ((1, "NVLink", 900e9 / 2), (2, "network", 400e9 / 8)):
        comms = comm_per_step(
            args,
            235_093_634_560,
            Layout(tp=tp, pp=1, dp=64 // tp, ep=8),
            cluster,
            seq_len=4096,
            local_batch=1,
            accum=2,
            experts=experts,
        )
        (a2a,) = [c for c in comms if c.dim == "ep"]
        # TP ranks route the whole sequence: the same bytes; 8 x TP 2 = 16 ranks span 2 nodes
        assert (a2a.bytes, a2a.link, a2a.exposed) == (2 * 88_315_265_024, link, True)
        assert a2a.seconds == pytest.approx(a2a.bytes / (bandwidth * 0.8))


def test_count_experts_from_the_ep_sharded_parameters():
    cfg = _moe_cfg("--model.flavor 235B-A22B")
    args = model_args_for(cfg, cfg.training.seq_len)
    experts = count_experts(get_model_spec("qwen3_moe"), args, cfg)
    assert experts == Experts(128, 8, 94, 94 * 128 * 3 * 4096 * 1536)
    assert count_experts(get_model_spec("llama3"), _args(_cfg()), _cfg()) is None


def test_advise_proposes_ep_inside_a_node_for_235b_on_8x8_gpus():
    """Qwen3-MoE 235B-A22B on 8 nodes x 8 GPUs of 141 GiB: an EP degree > 1 dividing the 128
    experts and the FSDP degree, its EP x TP group inside a node, fitting memory in the
    search and in the check with the real parallelize functions."""
    cli = _script()
    out = io.StringIO()
    args = ["--advise", "--config", "debug_model", *QWEN3_MOE.split(), "--model.flavor"]
    args += ["235B-A22B", "--training.seq_len", "4096", "--nodes", "8", "--device-memory-gib"]
    with contextlib.redirect_stdout(out):
        assert cli.main([*args, "141"]) == 0
    text = out.getvalue()
    found = re.search(r"Proposed: TP (\d+) x PP (\d+) x FSDP (\d+) \(EP (\d+) of them\)", text)
    assert found, text
    tp, pp, dp, ep = map(int, found.groups())
    assert ep > 1 and 128 % ep == 0 and dp % ep == 0 and ep * tp <= 8
    assert f"- EP {ep}: each rank holds {128 // ep} of the 128 experts" in text
    assert "run over NVLink" in text and "ep (" in text
    checked = text.split("Checked with the real parallelize functions")[1]
    assert f"tp={tp} ep={ep}" in checked and " fits" in checked
    assert "DOES NOT FIT" not in checked


def test_advise_search_for_235b_keeps_ep_groups_in_a_node_and_fits():
    cfg = _moe_cfg("--model.flavor 235B-A22B --training.seq_len 4096")
    args = model_args_for(cfg, cfg.training.seq_len)
    spec = get_model_spec("qwen3_moe")
    experts = count_experts(spec, args, cfg)
    work = Workload(args, 235_093_634_560, 1.6e11, 4096, 1024, spec.block_activation_bytes, 4)
    cluster = Cluster(nodes=8, memory_gib=141)
    advice = advise(dataclasses.replace(work, experts=experts), cluster)
    best = advice.best
    assert best is not None and best.layout.ep > 1 and fits(best, cluster)
    assert best.memory <= 0.9 * 141 * GIB
    assert all(c.layout.ep * c.layout.tp <= 8 for c in advice.tried)  # nothing crossed nodes
    assert {c.layout.ep for c in advice.tried} == {1, 2, 4, 8}
    # without experts the same shapes search TP x PP x FSDP only
    assert {c.layout.ep for c in advise(work, cluster).tried} == {1}


# ------------------------------------------------------------------------ context parallelism
LLAMA3_8B_128K = build_model_args("llama3", "8B", 131072)


def _cp_activations(cp: int, ac: str = "none", extra: str = ""):
    """Llama 3 8B's activation estimate per rank at 128K tokens on CP `cp` (one rank, TP 1)."""
    cfg = parse_args(
        f"--config llama3_8b --training.seq_len 131072 --activation_checkpoint.mode {ac} {extra}".split()
    )
    dims = ParallelDims.from_config(world_size=cp, dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=cp)
    spec = get_model_spec("llama3")
    return rank_activations(cfg, LLAMA3_8B_128K, dims, 0, 32, True, spec.block_activation_bytes)


def test_cp_terms_by_hand_for_llama3_8b_at_128k():
    """Per layer a CP 2 rank adds the gathered K and V at the 8 K/V heads beyond its own half
    (2 x 65,536 x 1024 x 2 B); once per micro-batch the block mask over its 65,536 queries and
    the 131,072 keys (512 x 1024 blocks of 128: 8 int32 tensors, both orientations), built
    under CP with or without document masking; one layer's K/V gradients at 128K tokens."""
    plain = attention_bytes(LLAMA3_8B_128K, 131072, 1, 1, 2)
    mask = 4 * (2 * (512 + 1024) + 4 * 512 * 1024)  # 8.0 MiB
    assert block_mask_bytes(65536, 131072, 1) == mask
    assert (plain.kv, plain.masks) == (256 << 20, mask)
    c = attention_bytes(LLAMA3_8B_128K, 131072, 1, 1, 2, document_mask=True)
    assert (c.kv, c.masks) == (256 << 20, mask)
    assert c.transient == plain.transient == 2 * 131072 * 1024 * 2  # 512 MiB
    alone = attention_bytes(LLAMA3_8B_128K, 131072, 1, 1, 1)
    assert (alone.per_layer, alone.masks, alone.transient) == (0, 0, 0)
    at_tp2 = attention_bytes(LLAMA3_8B_128K, 131072, 1, 2, 4, document_mask=True)
    assert (at_tp2.kv, at_tp2.masks) == (2 * 98304 * 512 * 2, block_mask_bytes(32768, 131072, 1))


def test_block_masks_one_per_distinct_spec_that_needs_one():
    """The masks counted are those `attention_batch` builds: none for plain causal layers
    alone, one per distinct mask key otherwise (window and global layers with document
    masking: two; the same spec on every layer: one; the plain causal layers of a model with windows none without
    document masking), of the bytes of the real BlockMask's tensors."""
    from models.attention import AttentionSpec, attention_batch

    args, s, b = LLAMA3_8B_128K, 1024, 2
    local, window = AttentionSpec(window=256), AttentionSpec()
    cases = [((window,), False, 0), ((window,), True, 1), ((local, window), False, 1)]
    cases += [((local, window, local), True, 2), ((AttentionSpec(document_mask=False),), True, 0)]
    for specs, docs, n in cases:
        documents = (torch.arange(s) // 300).expand(b, -1) if docs else None
        batch = attention_batch(list(specs), b, s, torch.device("cpu"), documents=documents)
        masks = [] if batch is None else list(batch.masks.values())
        real = sum(t.nbytes for m in masks for t in m.as_tuple() if isinstance(t, torch.Tensor))
        estimated = attention_bytes(args, s, b, 1, 1, document_mask=docs, specs=specs).masks
        assert (len(masks), estimated) == (n, real) == (n, n * block_mask_bytes(s, s, b))


def test_selective_op_ac_counts_the_family_block():
    """Op-level selective AC keeps the family's count per layer (its upper bound: the
    backends keep no scores to drop), not Korthikanti's GPT count."""
    op = "--activation_checkpoint.selective_ac_option op"
    sel, none = _cp_activations(1, "selective", op), _cp_activations(1)
    assert sel.kept == 32 and sel.per_layer == sel.block == none.per_layer
    assert sel.total == none.total


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_cp_divides_the_per_rank_activations_by_its_degree(cp, ac):
    """What scales with the rank's tokens (the block count, full AC's kept inputs, the logits)
    falls exactly by the CP degree; the gathered K/V, the block mask and the transient come on
    top."""
    one, split = _cp_activations(1, ac), _cp_activations(cp, ac)
    c = attention_bytes(LLAMA3_8B_128K, 131072, 1, 1, cp)
    assert split.block * cp == one.block and split.logits * cp == one.logits
    assert split.per_checkpointed * cp == one.per_checkpointed
    if ac == "none":
        assert (one.kept, split.kept) == (32, 32)
        assert split.per_layer == one.per_layer / cp + c.kv
        extra = 32 * c.kv
    else:
        assert (one.checkpointed, split.checkpointed) == (32, 32)
        assert split.recompute == one.recompute / cp + c.kv
        extra = c.kv
        assert split.total < one.total  # only the recomputed layer keeps CP's full-length terms
    assert split.total == int(one.total / cp + extra + c.masks + c.transient)
    assert f"s=131072/cp {cp} = {131072 // cp}" in split.describe()


def test_cp_kv_all_gather_volume_by_hand():
    """Llama 3 8B at 128K on CP 2: per layer K and V of 131,072 x 1024 bf16 (256 MiB each)
    gathered, half of it from the other rank, and their gradients reduce-scattered back:
    2 passes x 32 layers x 512 MiB x 1/2 = 16 GiB per micro-step; full AC gathers again."""
    assert kv_all_gather_bytes(131072, 1, 1024, 2, 32, 2, recompute=False) == 16 << 30
    assert kv_all_gather_bytes(131072, 1, 1024, 2, 32, 2, recompute=True) == 24 << 30
    assert kv_all_gather_bytes(131072, 1, 1024, 1, 32, 2, recompute=False) == 0
    n = 8_030_261_248
    for tp, cp, link in ((1, 8, "NVLink"), (2, 4, "NVLink"), (4, 4, "network")):
        layout = Layout(tp=tp, pp=1, dp=16 // (tp * cp), cp=cp)
        comms = comm_per_step(
            LLAMA3_8B_128K, n, layout, Cluster(nodes=2), seq_len=131072, local_batch=1, accum=2
        )
        by = {c.dim: c for c in comms}
        kv_dim = 1024 // tp  # TP splits the kv heads
        expected = 2 * kv_all_gather_bytes(131072, 1, kv_dim, cp, 32, 2, recompute=False)
        assert (by["cp"].bytes, by["cp"].link, by["cp"].exposed) == (expected, link, True)
        # FSDP spans dp x cp: the weights are gathered over all of them
        assert by["dp_shard_cp"].size == layout.dp * cp == 16 // tp


def test_ulysses_volume_and_memory_by_hand():
    """Llama 3 8B at 128K, Ulysses: per layer each rank's q and output (65,536 x 4096 bf16 at
    CP 2) and k and v (x 1024) go to head shards and back, half of each leaving the rank, and
    their gradients in backward: 2 x 32 x 65,536 x 10,240 x 2 B / 2 = 40 GiB per micro-step at
    CP 2, falling as 1/cp, where the K/V all-gather grows toward the whole sequence's K/V. In
    memory no gathered K/V; each layer keeps the whole sequence's block mask, and one layer's
    backward the all-to-all buffers; the CP comm line of a Ulysses layout counts it."""
    by_cp = {cp: ulysses_all_to_all_bytes(131072, 1, 4096, 1024, cp, 32, 2, recompute=False)
             for cp in (2, 4, 8)}  # fmt: skip
    assert by_cp[2] == 40 << 30 and by_cp[4] == by_cp[2] * 3 / 4 and by_cp[8] == by_cp[2] * 7 / 16
    gathers = [kv_all_gather_bytes(131072, 1, 1024, cp, 32, 2, False) for cp in (2, 4, 8)]
    assert gathers == sorted(gathers) and gathers[0] < gathers[-1]
    c = attention_bytes(LLAMA3_8B_128K, 131072, 1, 1, 2, method="ulysses")
    mask = block_mask_bytes(65536, 131072, 1)
    assert (c.kv, c.masks) == (block_mask_bytes(131072, 131072, 1), mask)
    assert c.transient == 2 * 65536 * (4096 + 1024) * 2
    layout = Layout(tp=1, pp=1, dp=4, cp=2, cp_method="ulysses")
    n = 8_030_261_248
    comms = comm_per_step(
        LLAMA3_8B_128K, n, layout, Cluster(nodes=1), seq_len=131072, local_batch=1, accum=1
    )
    cp = next(c for c in comms if c.dim == "cp")
    assert cp.bytes == by_cp[2] and "Ulysses" in cp.what


def test_advise_search_with_cp_keeps_the_world_and_the_chunks():
    """Every layout tried multiplies to the world size with its CP degree, uses CP degrees that
    are powers of two splitting the sequence into 2 x cp chunks, and the FSDP states of a CP
    layout are those of FSDP over dp x cp ranks."""
    spec = get_model_spec("llama3")
    work = Workload(LLAMA3_8B_128K, 8_030_261_248, 2.5e11, 131072, 32, spec.block_activation_bytes)
    cluster = Cluster(nodes=1, memory_gib=141)
    advice = advise(work, cluster)
    assert all(c.layout.tp * c.layout.pp * c.layout.dp * c.layout.cp == 8 for c in advice.tried)
    assert {c.layout.cp for c in advice.tried} == {1, 2, 4, 8}
    assert all(c.layout.cp * c.layout.tp <= 8 for c in advice.tried)
    odd = dataclasses.replace(work, seq_len=131072 + 8)  # 2 x 8 chunks do not divide it
    assert {c.layout.cp for c in advise(odd, cluster).tried} == {1, 2, 4}
    best = advice.best
    assert best is not None and best.layout.cp > 1 and fits(best, cluster)
    assert not any(fits(c, cluster) for c in advice.tried if c.layout.cp == 1 and c.layout.tp == 1)
    # the search's states are FSDP's over dp x cp: CP 4 x FSDP 2 differs from FSDP 8 alone by
    # the activations only
    block, n = spec.block_activation_bytes, 8_030_261_248
    split, alone = Layout(1, 1, 2, ac="full", cp=4), Layout(1, 1, 8, ac="full")
    mem = [analytic_memory(LLAMA3_8B_128K, n, x, 131072, 1, 128256, block) for x in (split, alone)]
    act = [
        analytic_activations(LLAMA3_8B_128K, x, 131072, 1, 128256, block) for x in (split, alone)
    ]
    assert mem[0] - mem[1] == pytest.approx(act[0] - act[1], abs=2)
    # both CP methods are tried where each TP x CP rank gets whole heads (8 KV heads: copies
    # up to CP 8 at TP 1), the all-gather alone without CP or where the heads do not split
    methods = {(c.layout.tp, c.layout.cp, c.layout.cp_method) for c in advice.tried}
    assert {(1, 8, "ulysses"), (2, 4, "ulysses"), (1, 2, "allgather")} <= methods
    assert all(m == "allgather" for t, cp, m in methods if cp == 1)
    kv6 = dataclasses.replace(
        LLAMA3_8B_128K, dim=4080, n_heads=24, n_kv_heads=6
    )  # 6 KV heads: split by CP 2, neither split by nor dividing CP 4 or 8
    tried = {(c.layout.tp, c.layout.cp, c.layout.cp_method)
             for c in advise(dataclasses.replace(work, model_args=kv6), cluster).tried}  # fmt: skip
    assert (1, 2, "ulysses") in tried and (1, 2, "allgather") in tried
    assert not any(m == "ulysses" for t, cp, m in tried if cp in (4, 8) and t == 1)


def test_advise_proposes_cp_for_llama3_8b_at_128k_on_8_gpus():
    """Llama 3 8B at 128K on one node of 8 GPUs of 141 GB (131 GiB): CP > 1, and why: CP 1 does
    not fit, CP's K/V traffic against TP's at the same degree, the other CP degrees."""
    cli = _script()
    out = io.StringIO()
    args = ["--advise", "--config", "llama3_8b", "--training.seq_len", "131072"]
    with contextlib.redirect_stdout(out):
        assert cli.main([*args, "--nodes", "1", "--device-memory-gib", "131"]) == 0
    text = out.getvalue()
    found = re.search(r"Proposed: TP (\d+) x PP (\d+) x CP (\d+) x FSDP (\d+)", text)
    assert found, text
    tp, pp, cp, dp = map(int, found.groups())
    assert cp > 1 and tp * pp * cp * dp == 8
    assert f"- CP {cp}: each rank holds {131072 // cp:,} of every sequence's 131,072" in text
    assert f"- CP 1 at TP {tp} x PP {pp}: does not fit" in text
    assert f"- CP {cp} instead of TP {tp * cp}: CP sends" in text
    assert f"cp ({cp} ranks over NVLink)" in text
    checked = text.split("Checked with the real parallelize functions")[1]
    assert f"tp={tp} ep=1 cp={cp}" in checked and " fits" in checked
    assert f"s=131072/cp {cp} = {131072 // cp}" in checked


@pytest.mark.parametrize("world,tp,cp", [(4, 1, 2), (4, 1, 4), (8, 2, 2)])
def test_cp_states_are_sharded_over_dp_shard_x_cp(world, tp, cp):
    """The real parallelize functions (FSDP over "dp_shard_cp"): a CP layout holds the same
    parameter, gradient and AdamW bytes as FSDP alone over its dp_shard x cp ranks, and the
    world is pp x dp_replicate x dp_shard x cp x tp."""
    spec = get_model_spec("llama3")
    cfg = _cfg(f"--parallelism.tensor_parallel_degree {tp}")
    base = simulate(spec, _args(cfg), cfg, world, device_type="cpu", ranks=[0]).ranks[0]
    cfg = _cfg(
        f"--parallelism.tensor_parallel_degree {tp} --parallelism.context_parallel_degree {cp}"
    )
    plan = simulate(spec, _args(cfg), cfg, world, device_type="cpu", ranks=[0])
    assert plan.dims.dp_shard * plan.dims.cp * plan.dims.tp == world
    assert plan.dims.dp_shard == world // (tp * cp)
    rank = plan.ranks[0]
    assert (rank.params, rank.grads, rank.optimizer) == (base.params, base.grads, base.optimizer)
    n = 647_488  # the tiny model's parameters
    if tp == 1:  # fp32 on CPU, 1/world of every parameter
        assert rank.params == 4 * n // world


def test_document_mask_adds_its_block_mask_without_cp():
    """Document masking at CP 1 adds one block mask per micro-batch (int32 block indices over
    1024 x 1024 blocks of 128 tokens, 16 MiB at 128K), nothing per layer: the block-sparse
    kernels keep what SDPA keeps."""
    plain, masked = _cp_activations(1), _cp_activations(1, extra="--training.document_mask")
    a = attention_bytes(LLAMA3_8B_128K, 131072, 1, 1, 1, document_mask=True)
    assert (a.kv, a.masks, a.transient) == (0, 4 * (2 * 2048 + 4 * 1024 * 1024), 0)
    assert masked.total == plain.total + a.masks


def test_cp_attention_terms_equal_what_autograd_saves_on_cpu():
    """One bf16 grouped-query Llama block (8 heads, 2 K/V heads) on CP rank 0 of 4, 256 of 1024
    tokens, through the real CP attention (`apply_context_parallel`: K/V all-gathered over a
    fake 4-rank group, which gives the gathered sizes) with the rank's positions and documents
    from `sequence_inputs` and the model's block masks (`attention_batch`). What autograd saves
    beyond the same block on 256 tokens alone (same document-masked backend) is exactly
    `attention_bytes`' per-layer term, the full-length K and V at the K/V heads' size instead
    of the local ones; the block mask's tensors are its `masks` term."""
    from torch.distributed.device_mesh import init_device_mesh

    from models.attention import attention_batch
    from parallelisms.context_parallel import apply_context_parallel
    from training.inputs import SequenceSplit, sequence_inputs

    s, cp, b = 1024, 4, 1
    local = s // cp
    shape = {"dim": 256, "n_heads": 8, "n_kv_heads": 2}
    args = build_model_args("llama3", "debugmodel", s, None, shape)
    model = get_model_spec("llama3").model_cls(args).to(torch.bfloat16)
    model.init_buffers("cpu")
    specs = model.attention_specs
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip.add(model.rope.untyped_storage().data_ptr())
    x = torch.randn(b, local, args.dim, dtype=torch.bfloat16, requires_grad=True)

    def coordinates(batch):
        tensors = [batch.positions, batch.key_positions, batch.documents, batch.key_documents]
        tensors += [t for m in batch.masks.values() for t in m.as_tuple()]
        return [t for t in tensors if isinstance(t, torch.Tensor)]

    # document masking over one document (no end token): causal, through the block mask
    docs = torch.zeros(b, local, dtype=torch.int32)
    own = attention_batch(specs, b, local, torch.device("cpu"), documents=docs)
    skip |= {t.untyped_storage().data_ptr() for t in coordinates(own)}
    alone = _saved_bytes(model.layers["0"], x, skip, model.rope, own)
    tokens = torch.zeros(b, s, dtype=torch.long)
    one = torch.zeros(b, s, dtype=torch.int32)
    _, _, inputs = sequence_inputs(SequenceSplit(0, cp, document_mask=True), tokens, tokens, one)
    batch = attention_batch(specs, b, local, torch.device("cpu"), **inputs)
    rope = model.rope[inputs["positions"]]
    skip |= {t.untyped_storage().data_ptr() for t in [rope, *coordinates(batch)]}
    with fake_world(cp):
        assert apply_context_parallel(model, init_device_mesh("cpu", (cp,))) == args.n_layers
        with_cp = _saved_bytes(model.layers["0"], x, skip, rope, batch)
    c = attention_bytes(args, s, b, 1, cp, document_mask=True, specs=specs)
    assert c.kv == 2 * (s - local) * 64 * 2
    assert with_cp - alone == c.kv
    (mask,) = batch.masks.values()
    assert c.masks == sum(t.nbytes for t in mask.as_tuple() if isinstance(t, torch.Tensor))
