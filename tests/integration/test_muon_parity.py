"""Muon (`--optimizer.name Muon`, training/muon.py) gives one process's update under every
layout. In float64, with Newton-Schulz in the weights' dtype (`optimizer.muon_ns_dtype =
"param"`), FSDP 2, HSDP 2 x 2 (replicas compute their own owner's result), TP 2, TP 2 x FSDP 2 (2-D
shard groups: FSDP's strided shards of TP's), PP 2 and EP 2 (each expert its own matrix, every
rank holding whole ones) equal one process within `parity.FP64` (1e-10 relative) in loss and
gradient norm at every step and in the final weights, and build the layout asked for. FSDP 2's
step-4 checkpoint (the momentum buffers with it) resumes resharded onto TP 2 at the same
tolerance. One process equals torch.optim.Muon: tests/unit/test_muon.py.
"""

from __future__ import annotations

import parity
import pytest
import torch
from dist_utils import Run
from parity import FP64, Layout, table

STEPS = 8
COMMON = ["--training.steps", str(STEPS), "--checkpoint.enable", "true",
          "--checkpoint.interval", "4", "--training.mixed_precision_param", "float64",
          "--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "param"]  # fmt: skip
REFERENCES = {
    "llama": (),
    "moe": ("--model.name=qwen3_moe", "--optimizer.lr=1e-3"),  # lr: see test_moe_parity.py
}
TP2 = "--parallelism.tensor_parallel_degree=2"
PP2 = ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B",
       "--parallelism.pipeline_parallel_microbatch_size=2")  # fmt: skip
# fmt: off
LAYOUTS = table(
    Layout("muon_fsdp2", 2, ("--training.local_batch_size=4",), "llama", FP64),
    Layout("muon_hsdp", 4, ("--parallelism.data_parallel_replicate_degree=2", "--training.local_batch_size=2"), "llama", FP64),
    Layout("muon_tp2", 2, (TP2,), "llama", FP64),
    Layout("muon_tp2_fsdp2", 4, (TP2, "--training.local_batch_size=4"), "llama", FP64),
    Layout("muon_pp2", 2, PP2, "llama", FP64),
    Layout("muon_moe_ep2", 2, (*REFERENCES["moe"], "--parallelism.expert_parallel_degree=2", "--training.local_batch_size=4"), "moe", FP64),
)
# fmt: on
RESUMED = Layout("muon_fsdp2_to_tp2", 2, (TP2,), "llama", FP64, after="muon_fsdp2")


def pool_runs(selected):
    runs = parity.family_pool_runs(selected, COMMON, REFERENCES, LAYOUTS, needs={
        "test_muon_resumes_resharded": ("muon_fsdp2", "llama")})  # fmt: skip
    if any(item.originalname == "test_muon_resumes_resharded" for item in selected):
        load = ["--checkpoint.initial_load_path={run:muon_fsdp2}/checkpoint/step-4",
                "--checkpoint.initial_load_model_only=false"]  # fmt: skip
        runs.append(Run(RESUMED.id, 2, [*COMMON, *RESUMED.args, *load], after=RESUMED.after))
    return runs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_layout_matches_one_process(runs, name):
    row = LAYOUTS[name]
    run, ref = runs[name].check(), runs[row.reference].check()
    assert "optimizer: Muon" in run.output, "the run did not report Muon"
    parity.assert_layout(
        run.folder, run.nproc, run.args, 2, parity.moe_local_blocks(run.nproc, run.args, 2)
    )
    assert {w.dtype for w in parity.final_weights(run.folder, STEPS).values()} == {torch.float64}
    worst = parity.assert_parity(ref.folder, run.folder, row.tol, step=STEPS)
    if "moe" in name:
        parity.assert_router_parity(ref.folder, run.folder, tol=FP64.loss)
    print(f"\n{name}: loss {worst['loss']:.1e} grad norm {worst['grad_norm']:.1e} weights "
          f"{worst['max_rel']:.1e} ({worst['worst']})")  # fmt: skip


def test_muon_resumes_resharded(runs):
    run, ref = runs[RESUMED.id].check(), runs["llama"].check()
    assert "checkpoint: loaded" in run.output
    assert sorted(run.losses()) == list(range(5, STEPS + 1))
    parity.assert_layout(run.folder, run.nproc, run.args)
    parity.assert_parity(ref.folder, run.folder, FP64, first=5, step=STEPS)
