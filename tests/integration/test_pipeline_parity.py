"""Pipeline-parallel training matches one process, for every schedule torch provides.

The tiny model (tests/tiny_model.toml, here with 4 layers so that multi-stage schedules get
2 stages of 1 layer per rank; 8 layers for 4 ranks of 2 stages) trains 10 steps in fp32 with
deterministic algorithms and a global batch of 8 sequences. Each run must match the
one-process run of its depth under the harness in `tests/parity.py` (loss and gradient norm
at every step, the global norm over all pipeline stages clipped to 0.7; final weights; the
layout it built), and so must the validation loss (every 5 steps), which runs each
schedule's forward-only path. Only the runs the selected tests need are launched.
"""

from __future__ import annotations

import dataclasses

import pytest
from dist_utils import Run
from parity import (
    CHECKPOINT_ARGS,
    FP32,
    STEPS,
    Layout,
    assert_layout,
    assert_parity,
    assert_series,
    by_step,
    family_runs,
    links,
    options,
    selected_runs,
    table,
)

from parallelisms.pipeline import v_schedules_on_gloo

CLIP = 0.7  # below half the steps' gradient norm, so clipping (global over stages) is exercised
COMMON = [
    "--model.n_layers", "4", "--training.max_norm", str(CLIP), "--training.steps", str(STEPS),
    "--validation.enable", "true", "--validation.freq", "5", "--validation.steps", "2",
    *CHECKPOINT_ARGS,
]  # fmt: skip
EIGHT_LAYERS = ["--model.n_layers", "8"]
# 8 stages over 4 ranks: the fp32 tolerances, but element-wise on the final weights. Measured
# (2026-12-03, a Xeon with AVX-512 and no AVX-512 BF16): layers.1's wv 3.7e-4 element-wise (max
# abs 3.2e-5), norm-wise 2.7e-5; the same run in float64 equals the 8-layer reference to 1.3e-13
# element-wise, so it is float32 noise. Kept at about 3x.
DEEP_FP32 = dataclasses.replace(FP32, weights=1e-3)


# Every run validates on the same 16 sequences as the reference (`--validation.steps` 2 global
# batches of 8, however a run splits them into local and micro-batches). Local batch 8 unless
# set; microbatch sizes vary the number of microbatches (2, 4 or 8) per schedule step.
# Reference: the one-process run of the same depth ("reference": 4 layers).
# fmt: off
LAYOUTS = table(
    # single-stage schedules: 1 stage of 2 layers per rank
    Layout("pp2_gpipe", 2, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=GPipe", "--parallelism.pipeline_parallel_microbatch_size=2")),
    Layout("pp2_1f1b", 2, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=1")),
    # multi-stage schedules: 2 stages of 1 layer per rank, looped or (ZBV, DualPipeV) V-shaped
    Layout("pp2_interleaved_1f1b", 2, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=Interleaved1F1B", "--parallelism.pipeline_parallel_microbatch_size=2")),
    Layout("pp2_looped_bfs", 2, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=LoopedBFS", "--parallelism.pipeline_parallel_microbatch_size=4")),
    Layout("pp2_interleaved_zb", 2, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=InterleavedZeroBubble", "--parallelism.pipeline_parallel_microbatch_size=2")),
    Layout("pp2_zbv", 2, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble", "--parallelism.pipeline_parallel_microbatch_size=2")),
    Layout("pp2_dualpipev", 2, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=DualPipeV", "--parallelism.pipeline_parallel_microbatch_size=2")),
    # split backward (input, then weight pass) recomputes each checkpointed block once per
    # pass; per-op selective AC is refused with these schedules (one backward per region)
    Layout("pp2_zbv_ac_every_2", 2, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble", "--parallelism.pipeline_parallel_microbatch_size=2", "--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2")),
    # compiled blocks and loss under split backward: the first pass keeps the graph for the
    # second, so the compiled backward must not donate its buffers (build_schedule)
    Layout("pp2_zbv_compile", 2, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble", "--parallelism.pipeline_parallel_microbatch_size=2", "--compile.enable=true")),
    # gradient accumulation (4 schedule steps per optimizer step) and an uneven explicit split
    Layout("pp2_1f1b_accum_split", 2, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=1", "--training.local_batch_size=2", "--training.global_batch_size=8", '--parallelism.pipeline_parallel_split_points=["layers.1"]')),
    # PP x ZeRO-1 with accumulation (2 steps) under split backward: the weight pass fires no
    # gradient hook, so the step reduces what it left (training/step.py)
    Layout("pp2_zero1_interleaved_zb_accum", 4, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=InterleavedZeroBubble", "--parallelism.pipeline_parallel_microbatch_size=1", "--training.local_batch_size=2", "--training.global_batch_size=8", "--parallelism.zero_stage=1")),
    # PP x FSDP with accumulation (2 steps); the pipeline runtime drives FSDP's reduction
    Layout("pp2_fsdp2_zbv_accum", 4, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble", "--parallelism.pipeline_parallel_microbatch_size=1", "--training.local_batch_size=2", "--training.global_batch_size=8")),
    # 3-D: PP 2 x FSDP 2 x TP 2 (loss parallel on the last stage), looped (V-shaped schedules
    # with FSDP are the ZBV run above; a V-shaped 3-D run would add 8 more processes)
    Layout("pp2_fsdp2_tp2_interleaved_1f1b", 8, ("--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=Interleaved1F1B", "--parallelism.pipeline_parallel_microbatch_size=2", "--training.local_batch_size=4", "--parallelism.tensor_parallel_degree=2")),
    # 4 stages on 4 ranks; 8 stages (2 per rank) over 8 layers, against the 8-layer reference
    Layout("pp4_1f1b", 4, ("--parallelism.pipeline_parallel_degree=4", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=1")),
    Layout("pp4_interleaved_1f1b", 4, ("--parallelism.pipeline_parallel_degree=4", "--parallelism.pipeline_parallel_schedule=Interleaved1F1B", "--parallelism.pipeline_parallel_microbatch_size=2", "--model.n_layers=8"), "reference_8_layers", DEEP_FP32),
)
# fmt: on


# torch < 2.13 cannot run the V schedules on gloo; train.py rejects them up front there.
V_ON_GLOO = v_schedules_on_gloo()


def _v_schedule(args: tuple[str, ...]) -> bool:
    return options(args)["parallelism.pipeline_parallel_schedule"] in ("ZBVZeroBubble", "DualPipeV")


PARAMS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            _v_schedule(row.args) and not V_ON_GLOO, reason="V schedules on gloo need torch >= 2.13"
        ),
    )
    for name, row in LAYOUTS.items()
]


def pool_runs(selected):
    want = selected_runs(selected, LAYOUTS, {}, *links(LAYOUTS)) | {"reference"}
    want = {n for n in want if n not in LAYOUTS or V_ON_GLOO or not _v_schedule(LAYOUTS[n].args)}
    todo = family_runs(want, COMMON, {}, LAYOUTS)
    todo.append(Run("reference", 1, COMMON))
    if "reference_8_layers" in want:
        todo.append(Run("reference_8_layers", 1, COMMON + EIGHT_LAYERS))
    return todo


@pytest.mark.parametrize("name", PARAMS)
def test_pipeline_matches_one_process(runs, name):
    ref, run = runs[LAYOUTS[name].reference].check(), runs[name].check()
    assert_layout(run.folder, run.nproc, run.args, n_layers=4)
    assert_parity(ref.folder, run.folder, LAYOUTS[name].tol)
    val = by_step(ref.folder, "loss", kind="validation")
    assert sorted(val) == list(range(5, STEPS + 1, 5))
    assert_series(val, by_step(run.folder, "loss", kind="validation"), "validation loss", FP32.loss)


def test_reference_clips_at_least_once(runs):
    # Otherwise the grad-norm parity above would not show that clipping spans the stages.
    assert any(r["grad_norm"] > CLIP for r in runs["reference"].check().records())
