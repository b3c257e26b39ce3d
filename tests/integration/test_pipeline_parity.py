"""Pipeline-parallel training matches one process, for every schedule torch provides.

The tiny model (tests/tiny_model.toml, here with 4 layers so that multi-stage schedules get
2 stages of 1 layer per rank; 8 layers for 4 ranks of 2 stages) trains 20 steps in fp32 with
deterministic algorithms and a global batch of 8 sequences. Each run must match the
one-process run of its depth under the harness in `tests/parity.py` (loss and gradient norm
at every step, the global norm over all pipeline stages clipped to 0.8; final weights; the
layout it built), and so must the validation loss (every 5 steps), which runs each
schedule's forward-only path. Only the runs the selected tests need are launched.
"""

from __future__ import annotations

import pytest
from dist_utils import Run, launch_many
from parity import (
    CHECKPOINT_ARGS,
    FP32,
    STEPS,
    assert_layout,
    assert_parity,
    assert_series,
    by_step,
    selected_runs,
)

from parallelisms.pipeline import v_schedules_on_gloo

CLIP = 0.8  # below most steps' gradient norm, so clipping (global over stages) is exercised
COMMON = [
    "--model.n_layers", "4", "--training.max_norm", str(CLIP), "--training.steps", str(STEPS),
    "--validation.enable", "true", "--validation.freq", "5", "--validation.steps", "2",
    *CHECKPOINT_ARGS,
]  # fmt: skip
EIGHT_LAYERS = ["--model.n_layers", "8"]


def _pp(schedule: str, microbatch: int, pp: str = "2", **kw) -> list[str]:
    args = [
        "--parallelism.pipeline_parallel_degree", pp,
        "--parallelism.pipeline_parallel_schedule", schedule,
        "--parallelism.pipeline_parallel_microbatch_size", str(microbatch),
    ]  # fmt: skip
    for key, value in kw.items():
        args += [f"--{key.replace('__', '.')}", value]
    return args


LB, GB = "training__local_batch_size", "training__global_batch_size"
TP = "parallelism__tensor_parallel_degree"
SPLIT = "parallelism__pipeline_parallel_split_points"
ZERO = "parallelism__zero_stage"
# Validation batches per evaluation: runs with a smaller local batch take more of them, so
# every run validates on the same 16 sequences as the reference (2 batches of 8).
VS = "validation__steps"

AC_EVERY_2 = {"activation_checkpoint__mode": "selective",
              "activation_checkpoint__selective_ac_option": "2"}  # fmt: skip

# name: (ranks, arguments). Local batch 8 unless set; microbatch sizes vary the number of
# microbatches (2, 4 or 8) per schedule step.
LAYOUTS = {
    # single-stage schedules: 1 stage of 2 layers per rank
    "pp2_gpipe": (2, _pp("GPipe", 2)),
    "pp2_1f1b": (2, _pp("1F1B", 1)),
    # multi-stage schedules: 2 stages of 1 layer per rank, looped or (ZBV, DualPipeV) V-shaped
    "pp2_interleaved_1f1b": (2, _pp("Interleaved1F1B", 2)),
    "pp2_looped_bfs": (2, _pp("LoopedBFS", 4)),
    "pp2_interleaved_zb": (2, _pp("InterleavedZeroBubble", 2)),
    "pp2_zbv": (2, _pp("ZBVZeroBubble", 2)),
    "pp2_dualpipev": (2, _pp("DualPipeV", 2)),
    # split backward (input, then weight pass) recomputes each checkpointed block once per
    # pass; per-op selective AC is refused with these schedules (one backward per region)
    "pp2_zbv_ac_every_2": (2, _pp("ZBVZeroBubble", 2, **AC_EVERY_2)),
    # compiled blocks and loss under split backward: the first pass keeps the graph for the
    # second, so the compiled backward must not donate its buffers (build_schedule)
    "pp2_zbv_compile": (2, _pp("ZBVZeroBubble", 2, compile__enable="true")),
    # gradient accumulation (4 schedule steps per optimizer step) and an uneven explicit split
    "pp2_1f1b_accum_split": (
        2,
        _pp("1F1B", 1, **{LB: "2", GB: "8", SPLIT: '["layers.1"]', VS: "8"}),
    ),
    # PP x ZeRO-1 with accumulation (2 steps) under split backward: the weight pass fires no
    # gradient hook, so the step reduces what it left (training/step.py)
    "pp2_zero1_interleaved_zb_accum": (
        4,
        _pp("InterleavedZeroBubble", 1, **{LB: "2", GB: "8", VS: "4", ZERO: "1"}),
    ),
    # PP x FSDP with accumulation (2 steps); the pipeline runtime drives FSDP's reduction
    "pp2_fsdp2_zbv_accum": (4, _pp("ZBVZeroBubble", 1, **{LB: "2", GB: "8", VS: "4"})),
    # 3-D: PP 2 x FSDP 2 x TP 2 (loss parallel on the last stage), looped (V-shaped schedules
    # with FSDP are the ZBV run above; a V-shaped 3-D run would add 8 more processes)
    "pp2_fsdp2_tp2_interleaved_1f1b": (8, _pp("Interleaved1F1B", 2, **{LB: "4", TP: "2"})),
    # 4 stages on 4 ranks; 8 stages (2 per rank) over 8 layers
    "pp4_1f1b": (4, _pp("1F1B", 1, pp="4")),
    "pp4_interleaved_1f1b": (4, _pp("Interleaved1F1B", 2, pp="4") + EIGHT_LAYERS),
}
REFERENCE = {"pp4_interleaved_1f1b": "reference_8_layers"}  # the rest: "reference" (4 layers)


# torch < 2.13 cannot run the V schedules on gloo; train.py rejects them up front there.
V_ON_GLOO = v_schedules_on_gloo()


def _v_schedule(args: list[str]) -> bool:
    return any(a in ("ZBVZeroBubble", "DualPipeV") for a in args)


PARAMS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            _v_schedule(args) and not V_ON_GLOO, reason="V schedules on gloo need torch >= 2.13"
        ),
    )
    for name, (_, args) in LAYOUTS.items()
]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    base = tmp_path_factory.mktemp("pp_parity")
    want = selected_runs(request, LAYOUTS, {}, REFERENCE) | {"reference"}
    todo = [
        Run(name, base / name, n, COMMON + args)
        for name, (n, args) in LAYOUTS.items()
        if name in want and (V_ON_GLOO or not _v_schedule(args))
    ]
    todo.append(Run("reference", base / "reference", 1, COMMON))
    if "reference_8_layers" in want:
        todo.append(Run("reference_8_layers", base / "reference8", 1, COMMON + EIGHT_LAYERS))
    # The widest runs are the slowest: start them first so the others overlap them.
    todo.sort(key=lambda r: -r.nproc)
    return launch_many(todo, parallel=2)


@pytest.mark.parametrize("name", PARAMS)
def test_pipeline_matches_one_process(runs, name):
    ref, run = runs[REFERENCE.get(name, "reference")].check(), runs[name].check()
    assert_layout(run.folder, run.nproc, run.args, n_layers=4)
    assert_parity(ref.folder, run.folder, FP32)
    val = by_step(ref.folder, "loss", kind="validation")
    assert sorted(val) == [5, 10, 15, 20]
    assert_series(val, by_step(run.folder, "loss", kind="validation"), "validation loss", FP32.loss)


def test_reference_clips_at_least_once(runs):
    # Otherwise the grad-norm parity above would not show that clipping spans the stages.
    assert any(r["grad_norm"] > CLIP for r in runs["reference"].check().records())
