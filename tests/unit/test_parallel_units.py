"""Unit checks of the parallelisms on small models, in this process: up-front layout
validation, activation checkpointing keys and numerics, and scripts/loss_compare.py. The
checks that need 2 ranks are in tests/integration/test_distributed_units.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from small_model import batch, tiny_model

from job_config import ConfigError, parse_args
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.parallel_dims import ParallelismError
from scripts import loss_compare
from training.loss import cross_entropy_sum
from training.preflight import check_config

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


@pytest.mark.parametrize("stage", ["0", "1", "2"])
def test_valid_tp_layout_passes_the_checks(stage):
    cfg = parse_args(["--config", "tests/tiny_model.toml", "--parallelism.tensor_parallel_degree",
                      "2", "--parallelism.zero_stage", stage])  # fmt: skip
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


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_ac_replays_dropout_masks_in_recomputation(p):
    """A block with active dropout gets its RNG state replayed when AC recomputes it, so the
    gradients equal the unwrapped block's; a block without dropout skips the replay."""
    from torch import nn

    from parallelisms.activation_checkpoint import apply_ac

    def model():
        torch.manual_seed(0)
        m = nn.Module()
        m.layers = nn.ModuleDict({"0": nn.Sequential(nn.Linear(8, 8), nn.Dropout(p))})
        return m

    ref, wrapped = model(), apply_ac(model(), "full")
    assert wrapped.layers["0"].checkpoint_fn.keywords["preserve_rng_state"] == (p > 0)
    x = torch.randn(4, 8)
    for m in (ref, wrapped):
        torch.manual_seed(1)
        m.layers["0"](x).square().sum().backward()
    for (name, a), b in zip(wrapped.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_ac_op_policy_saves_matmuls_and_recomputes_the_rest():
    from torch.utils.checkpoint import CheckpointPolicy

    from parallelisms.activation_checkpoint import _op_policy

    aten = torch.ops.aten
    assert _op_policy(None, aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert _op_policy(None, aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


def test_ac_op_policy_is_a_cacheable_compile_key():
    """AOT autograd caches a compiled block under per-op AC only when the policy names itself
    (`cache_hash` on the context_fn); the name must change with the ops the policy saves."""
    from parallelisms import activation_checkpoint as ac

    block = apply_ac(tiny_model(), "selective", "op").layers["0"]
    assert block.checkpoint_fn.keywords["context_fn"].cache_hash == ac.POLICY_HASH
    assert "aten.mm.default" in ac.POLICY_HASH and "aten.mul" not in ac.POLICY_HASH


@pytest.mark.parametrize(
    ("tp", "ep", "keyed"), [(1, 1, False), (2, 1, True), (1, 2, True)], ids=["fsdp", "tp", "ep"]
)
def test_compile_cache_keys_per_rank_only_where_a_graph_sees_a_mesh(monkeypatch, tp, ep, keyed):
    """A block graph under FSDP/DDP/ZeRO/CP/PP holds plain tensors and its collectives name
    their groups in the graph itself, so its cache key is its content and other ranks and
    layouts find it; a DTensor (TP, EP) carries its DeviceMesh, which the key hashes by type
    only, so there each rank and set of groups keys its own."""
    from dist_utils import fake_world

    from parallelisms.compile import key_compile_caches_to_rank
    from parallelisms.parallel_dims import ParallelDims

    monkeypatch.setenv("TORCH_COMPILE_CACHE_KEY_TAG", "user")
    with fake_world(4, rank=3), torch.compiler.config.patch(cache_key_tag=""):
        dims = ParallelDims.from_config(
            world_size=4, dp_replicate=1, dp_shard=-1, tp=tp, pp=1, ep=ep
        )
        dims.build_mesh("cpu")
        tag = key_compile_caches_to_rank(dims)
        assert torch.compiler.config.cache_key_tag == tag
        groups = ",".join(f"{d}={g}" for d, g in sorted(dims.group_names().items()))
    if keyed:
        assert tag == f"user meshtrain rank 3 groups {groups}"
    else:
        assert tag == ""


# --- distributed checks (spawned gloo ranks) ------------------------------------------------


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
