"""Unit checks of the parallelisms on small models: up-front layout validation, activation
checkpointing keys and numerics, ZeRO state (FQNs, shards, module registration), the global
gradient norm over mixed meshes, and scripts/loss_compare.py. The distributed ones run real
gloo process groups in spawned processes (one spawn per world size for all of its checks).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from dist_utils import spawn

from job_config import ConfigError, parse_args
from models.llama3 import ModelArgs, Transformer
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.init_weights import init_weights
from parallelisms.parallel_dims import ParallelismError
from scripts import loss_compare
from train import check_config
from training.loss import cross_entropy_sum

ARGS = ModelArgs(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16
)


def tiny_model(args: ModelArgs = ARGS, wrap=None) -> Transformer:
    """Built on meta, optionally parallelised by `wrap`, then materialised and initialised."""
    with torch.device("meta"):
        model = Transformer(args)
    if wrap is not None:
        wrap(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        init_weights(model, 0)
    model.init_buffers("cpu")
    return model


def batch(n: int = 4, seed: int = 0, vocab: int = 63) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab, (n, 16), generator=g) for _ in range(2))


# --- validation before any process group ------------------------------------------------------


@pytest.mark.parametrize(
    "world,argv,expected",
    [
        (2, ["--parallelism.tensor_parallel_degree", "2", "--model.n_kv_heads", "1"],
         "must divide n_kv_heads = 1"),
        (4, ["--parallelism.tensor_parallel_degree", "4", "--model.n_heads", "6",
             "--model.dim", "96", "--model.n_kv_heads", "6"], "n_heads = 6, n_kv_heads = 6"),
        (2, ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "33"],
         "training.seq_len = 33"),
        (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.zero_stage", "1"],
         "ZeRO-1/2 shard plain replicated parameters"),
        (4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.zero_stage",
             "2"], "HSDP (replicate x shard) is ZeRO-3 only"),
        (2, ["--parallelism.zero_stage", "2", "--training.enable_cpu_offload", "true"],
         "enable_cpu_offload = true needs FSDP"),
    ],
)  # fmt: skip
def test_impossible_layouts_fail_before_any_work(world, argv, expected):
    cfg = parse_args(["--config", "tests/tiny_model.toml", *argv])
    with pytest.raises((ConfigError, ParallelismError), match=re.escape(expected)):
        check_config(cfg, world)


def test_valid_tp_layout_passes_the_checks():
    cfg = parse_args(["--config", "tests/tiny_model.toml", "--parallelism.tensor_parallel_degree",
                      "2", "--parallelism.zero_stage", "0"])  # fmt: skip
    dims = check_config(cfg, 4)
    assert (dims.dp_shard, dims.tp) == (2, 2)


# --- activation checkpointing -----------------------------------------------------------------


@pytest.mark.parametrize("mode,option", [("full", "2"), ("selective", "2"), ("selective", "op")])
def test_ac_keeps_keys_and_numerics(mode, option):
    ref = tiny_model()
    model = tiny_model(wrap=lambda m: apply_ac(m, mode, option))
    wrapped = [k for k, b in model.layers.items() if type(b).__name__ == "CheckpointWrapper"]
    assert wrapped == (
        ["1", "3"] if option == "2" and mode == "selective" else ["0", "1", "2", "3"]
    )
    assert list(model.state_dict()) == list(ref.state_dict())
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    assert list(get_model_state_dict(model)) == list(ref.state_dict())
    x, y = batch()
    for m in (ref, model):
        cross_entropy_sum(m(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_ac_op_policy_saves_matmuls_and_recomputes_the_rest():
    from torch.utils.checkpoint import CheckpointPolicy

    from parallelisms.activation_checkpoint import _op_policy

    aten = torch.ops.aten
    assert _op_policy(None, aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert _op_policy(None, aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


# --- distributed checks (spawned gloo ranks) ------------------------------------------------


def _two_rank_checks(rank: int, world: int) -> None:
    """ZeRO-1/2 state and registration, FSDP2's units, and a mixed-mesh gradient norm, on 2
    ranks."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from parallelisms.memory_report import memory_report
    from parallelisms.zero import apply_zero
    from training.step import clip_grad_norm_

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    args = ModelArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=63, multiple_of=16, max_seq_len=16
    )  # an odd vocabulary: uneven shards
    ref = tiny_model(args)
    ref_sd = ref.state_dict()
    for stage in (1, 2):
        model = tiny_model(args, lambda m, s=stage: apply_zero(m, mesh, s))
        sd = get_model_state_dict(model)
        assert list(sd) == list(ref_sd)
        for k, v in sd.items():
            assert isinstance(v, DTensor) and v.placements == (Shard(0),), k
            torch.testing.assert_close(v.full_tensor(), ref_sd[k], msg=k)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)  # as the trainer
        x, y = batch(4, seed=rank)
        cross_entropy_sum(model(x), y).backward()
        # Outside forward/backward the module holds its master shards again.
        assert all(isinstance(p, DTensor) for p in model.parameters())
        with torch.no_grad():
            model(x)  # eval forward: also leaves the masters registered
        assert all(isinstance(p, DTensor) for p in model.parameters())
        clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        held = memory_report([model], opt)
        assert held.params >= 4 * sum(p.numel() for p in ref.parameters())
        opt.zero_grad()
        # After the step every rank's full parameters agree (all-gathered at the next forward).
        with torch.no_grad():
            model(x)
        for p in model._zero.params:
            full = p.compute.detach().clone()
            others = [torch.empty_like(full) for _ in range(world)]
            torch.distributed.all_gather(others, full)
            assert all(torch.equal(o, full) for o in others)

    # Mixed precision (bf16 compute, fp32 reduction): every stage's fp32 master gradient is
    # the average of the ranks' bf16 gradients, and each bf16 gradient is freed as soon as its
    # fp32 copy exists (not at the end of backward): when the embedding's gradient, the last
    # of backward, arrives, no other bf16 gradient is alive.
    bf16 = torch.bfloat16
    x, y = batch(4, seed=rank)
    low = tiny_model(args)
    for q in low.parameters():  # parameters only, as the compute copies (buffers stay fp32)
        q.data = q.data.to(bf16)
    cross_entropy_sum(low(x), y).backward()
    want = {}
    for name, q in low.named_parameters():
        g = q.grad.float()
        torch.distributed.all_reduce(g)
        want[name] = g / world
    for stage in (0, 1, 2):
        model = tiny_model(args, lambda m, s=stage: apply_zero(m, mesh, s, param_dtype=bf16))
        with torch.no_grad():
            model(x)  # installs the gradient hooks on the compute parameters
        zs = model._zero.params
        emb = next(p for p in zs if p.module is model.tok_embeddings)
        alive = []
        others = [p for p in zs if p is not emb]
        emb.compute.register_post_accumulate_grad_hook(
            lambda _, o=others, a=alive: a.append([p.name for p in o if p.compute.grad is not None])
        )
        cross_entropy_sum(model(x), y).backward()
        assert alive == [[]], (stage, alive)
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(got, want[name], rtol=0, atol=0, msg=f"{stage} {name}")

    # FSDP2 units: the embeddings are gathered only around their own forward (their backward
    # needs no weights), the final norm + output stay gathered from their forward into their
    # backward, and the gradients equal one process's.
    from models.llama3.parallelize import llama_fsdp_units
    from parallelisms.fsdp import apply_fsdp

    f32 = torch.float32
    model = tiny_model(
        args,
        lambda m: apply_fsdp(m, mesh, llama_fsdp_units(m), param_dtype=f32, reduce_dtype=f32),
    )

    def gathered(module) -> bool:  # FSDP2 registers plain tensors while a unit is gathered
        return not any(isinstance(p, DTensor) for p in module.parameters())

    seen = {}
    model.layers["1"].register_forward_hook(
        lambda *_: seen.update(emb=gathered(model.tok_embeddings), head=gathered(model.output))
    )

    def watch_embedding_backward(module, inputs, out) -> None:  # when its backward starts
        out.register_hook(lambda grad: seen.update(emb_backward=gathered(module)))

    model.tok_embeddings.register_forward_hook(watch_embedding_backward)
    x, y = batch(4, seed=0)
    loss = cross_entropy_sum(model(x), y)
    assert seen == {"emb": False, "head": False}, seen  # during the blocks' forward
    assert not gathered(model.tok_embeddings) and gathered(model.output)
    assert gathered(model.norm) and gathered(model.layers["1"]) and not gathered(model.layers["0"])
    loss.backward()
    assert seen["emb_backward"] is False, seen
    assert not any(
        gathered(m) for m in (model.tok_embeddings, model.output, *model.layers.values())
    )
    ref.zero_grad()
    cross_entropy_sum(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)

    # Gradient norm over a mix: plain tensors, DTensor shards, and replicated DTensors.
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(6, 3, generator=g) for _ in range(3)]
    params = [torch.nn.Parameter(torch.zeros(6, 3))]
    params[0].grad = fulls[0].clone()
    for full, placement in zip(fulls[1:], ("shard", "replicate")):
        from torch.distributed.tensor import Replicate

        pl = [Shard(0)] if placement == "shard" else [Replicate()]
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 3), mesh, pl))
        p.grad = distribute_tensor(full.clone(), mesh, pl)
        params.append(p)
    norm = clip_grad_norm_(params, 0.5)
    want = torch.linalg.vector_norm(torch.stack([f.norm() for f in fulls]))
    torch.testing.assert_close(norm, want)
    clipped = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
    total = torch.linalg.vector_norm(torch.stack([c.norm() for c in clipped]))
    torch.testing.assert_close(total, torch.tensor(0.5), rtol=1e-4, atol=0)


def test_distributed_units_two_ranks():
    spawn(_two_rank_checks, 2)


# --- scripts/loss_compare.py ------------------------------------------------------------------


def _write_run(folder, losses):
    folder.mkdir()
    lines = [json.dumps({"step": i + 1, "kind": "train", "loss": v}) for i, v in enumerate(losses)]
    lines.append(json.dumps({"step": 1, "kind": "validation", "loss": 99.0}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_loss_compare_table_and_exit_code(tmp_path, capsys):
    _write_run(tmp_path / "a", [2.0, 1.5, 1.0])
    _write_run(tmp_path / "b", [2.0, 1.5, 1.00001])
    _write_run(tmp_path / "c", [2.0, 1.6])
    assert loss_compare.read_metric(tmp_path / "a") == {1: 2.0, 2: 1.5, 3: 1.0}
    assert loss_compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--rtol", "1e-4"]) == 0
    out = capsys.readouterr().out
    assert "largest relative difference of b: 1.000e-05" in out
    assert loss_compare.main([str(tmp_path / "a"), str(tmp_path / "c"), "--rtol", "1e-4"]) == 1
    out = capsys.readouterr().out
    assert "largest relative difference of c: inf" in out and "FAIL" in out
