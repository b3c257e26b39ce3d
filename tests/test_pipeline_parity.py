"""Pipeline-parallel training matches one process, for every schedule torch provides.

The tiny model (tests/tiny_model.toml, here with 4 layers so that multi-stage schedules get
2 stages of 1 layer per rank) trains 10 steps in fp32 with deterministic algorithms and a
global batch of 8 sequences. At every step the loss and the gradient norm (the global norm
over all pipeline stages, clipped to 0.8) must equal the one-process run's within RTOL, and
so must the validation loss (steps 5 and 10), which runs each schedule's forward-only path.
"""

from __future__ import annotations

import pytest
from dist_utils import Run, launch_many

from parallelisms.pipeline import v_schedules_on_gloo
from scripts.loss_compare import compare

# Relative tolerance per step. Pipelining splits the batch into microbatches and layouts
# reorder float32 reductions, which moves losses by ~1e-7 relative; a wrong gradient or a
# mis-scaled loss moves them by 1e-3 or more.
RTOL = 1e-4

CLIP = 0.8  # below most steps' gradient norm, so clipping (global over stages) is exercised
COMMON = [
    "--model.n_layers", "4", "--training.max_norm", str(CLIP),
    "--validation.enable", "true", "--validation.freq", "5", "--validation.steps", "2",
]  # fmt: skip


def _pp(schedule: str, microbatch: int, **kw) -> list[str]:
    args = [
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", schedule,
        "--parallelism.pipeline_parallel_microbatch_size", str(microbatch),
    ]  # fmt: skip
    for key, value in kw.items():
        args += [f"--{key.replace('__', '.')}", value]
    return args


LB, GB = "training__local_batch_size", "training__global_batch_size"
TP = "parallelism__tensor_parallel_degree"
SPLIT = "parallelism__pipeline_parallel_split_points"
# Validation batches per evaluation: runs with a smaller local batch take more of them, so
# every run validates on the same 16 sequences as the reference (2 batches of 8).
VS = "validation__steps"

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
    # gradient accumulation (4 schedule steps per optimizer step) and an uneven explicit split
    "pp2_1f1b_accum_split": (
        2,
        _pp("1F1B", 1, **{LB: "2", GB: "8", SPLIT: '["layers.1"]', VS: "8"}),
    ),
    # PP x FSDP with accumulation (2 steps); the pipeline runtime drives FSDP's reduction
    "pp2_fsdp2_zbv_accum": (4, _pp("ZBVZeroBubble", 1, **{LB: "2", GB: "8", VS: "4"})),
    # 3-D: PP 2 x FSDP 2 x TP 2 (loss parallel on the last stage)
    "pp2_fsdp2_tp2_zbv": (8, _pp("ZBVZeroBubble", 2, **{LB: "4", TP: "2"})),
}


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
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("pp_parity")
    todo = [
        Run(name, base / name, n, COMMON + args)
        for name, (n, args) in LAYOUTS.items()
        if V_ON_GLOO or not _v_schedule(args)
    ]
    # The 8-rank run is the slowest: start it first so the others overlap it.
    todo.sort(key=lambda r: -r.nproc)
    todo.append(Run("reference", base / "reference", 1, COMMON))
    return launch_many(todo, parallel=2)


@pytest.mark.parametrize("name", PARAMS)
def test_pipeline_matches_one_process(runs, name):
    ref, run = runs["reference"].check(), runs[name].check()
    for kind, key in (("train", "loss"), ("train", "grad_norm"), ("validation", "loss")):
        series = {
            "1 process": {r["step"]: r[key] for r in ref.records(kind)},
            name: {r["step"]: r[key] for r in run.records(kind)},
        }
        assert len(series[name]) == (10 if kind == "train" else 2)
        table, worst = compare(series)
        assert worst[name] <= RTOL, f"{kind} {key} differs by {worst[name]:.2e}:\n" + "\n".join(
            table
        )


def test_reference_clips_at_least_once(runs):
    # Otherwise the grad-norm parity above would not show that clipping spans the stages.
    assert any(r["grad_norm"] > CLIP for r in runs["reference"].check().records())
