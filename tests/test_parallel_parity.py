"""Every parallel layout trains the tiny model exactly like one process.

All runs start from the same weights (initialisation is sharding-independent), read the same
global batches (the loader is DP-invariant), run in fp32 with deterministic algorithms, and
train 10 steps with the same global batch of 8 sequences. Loss and gradient norm (the global
norm, clipped to 1.0) must match the one-process run at every step within RTOL (1e-4; 2e-4
for the gradient norm, see below). Runs that add a feature on top of a DP layout (AC modes,
accumulation, offload, compile) check both at once.
"""

from __future__ import annotations

import pytest
from dist_utils import Run, launch_many

from scripts.loss_compare import compare

# Relative tolerance per step: layouts reorder float32 reductions (sharded matmuls, gradient
# averaging), which moves losses by ~1e-7 relative; a real bug moves them by 1e-3 or more.
RTOL = 1e-4
# The gradient norm gets twice that: the one-process reference's own fp32 norm of the
# 4096 x 64 output-projection gradient is ~3e-5 off the float64 value (CPU fp32 reduction);
# sharded layouts sum smaller pieces and land nearer the exact norm (measured: <= 5e-5 apart).
GRAD_NORM_RTOL = 2e-4


def _args(**kw) -> list[str]:
    out = []
    for key, value in kw.items():
        out += [f"--{key.replace('__', '.')}", str(value)]
    return out


def z(stage: int) -> dict:
    return {"parallelism__zero_stage": stage}


LB = "training__local_batch_size"
GB = "training__global_batch_size"
TP = "parallelism__tensor_parallel_degree"
AC = "activation_checkpoint__mode"
SAC = "activation_checkpoint__selective_ac_option"
NO_LOSS_PARALLEL = "parallelism__disable_loss_parallel"
COMPILE = "compile__enable"
SAVE_AT_5 = {"checkpoint__enable": "true", "checkpoint__interval": 5}

# name: (ranks, overrides). Global batch 8 everywhere; AC modes ride along with DP layouts
# (AC must not change numerics, and this also checks ZeRO's parameter swap under recompute).
LAYOUTS = {
    "ddp2_ac_full": (2, {**z(0), LB: 4, AC: "full"}),
    "zero1_2_ac_op": (2, {**z(1), LB: 4, AC: "selective", SAC: "op"}),
    "zero2_2_accum_ac_sel2": (2, {**z(2), LB: 2, GB: 8, AC: "selective", SAC: "2", **SAVE_AT_5}),
    "zero1_4": (4, {**z(1), LB: 2}),
    "zero2_4": (4, {**z(2), LB: 2}),
    "zero3_4": (4, {**z(3), LB: 2}),
    "hsdp_2x2": (4, {**z(3), LB: 2, "parallelism__data_parallel_replicate_degree": 2}),
    "tp2": (2, {TP: 2}),
    "tp2_fsdp2": (4, {TP: 2, LB: 4}),
    "tp2_ddp2_no_loss_parallel": (4, {**z(0), TP: 2, LB: 4, NO_LOSS_PARALLEL: "true"}),
    "fsdp2_offload_accum": (2, {LB: 2, GB: 8, "training__enable_cpu_offload": "true"}),
    # Compile: one process first (local 4 x 2 accumulation steps, so its block graphs have
    # the shapes the 2-rank run sees), then FSDP on 2 ranks, which finds them in the inductor
    # cache instead of running gcc again on both ranks at once.
    "compile_accum": (1, {LB: 4, GB: 8, COMPILE: "true"}),
    "fsdp2_compile": (2, {LB: 4, COMPILE: "true"}),
    "tp2_compile_ac_op": (2, {TP: 2, COMPILE: "true", AC: "selective", SAC: "op"}),
}
AFTER = {"fsdp2_compile": "compile_accum"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("parity")
    # A private inductor cache: torch 2.13 has handed a stale compiled TP graph from another
    # run's cache entries back (wrong losses), so only this session's compiles are reused.
    env = {"TORCHINDUCTOR_CACHE_DIR": str(base / "inductor_cache")}
    todo = [Run("reference", base / "reference", 1)]
    todo += [
        Run(name, base / name, n, _args(**kw), after=AFTER.get(name), env=env)
        for name, (n, kw) in LAYOUTS.items()
    ]
    # ZeRO-2 shards are FSDP's Shard(0) layout: its step-5 checkpoint resumes under ZeRO-3.
    saver = "zero2_2_accum_ac_sel2"
    saved = base / saver / "checkpoint"
    resume = {**z(3), LB: 4, "checkpoint__enable": "true"}
    resume["checkpoint__initial_load_path"] = saved / "step-5"  # the saver also wrote step-10
    resume["checkpoint__initial_load_model_only"] = "false"
    todo.append(Run("zero2_to_zero3_resume", base / "resume", 2, _args(**resume), after=saver))
    # Compile runs are the slowest: start them first so they overlap the others.
    todo.sort(key=lambda r: "compile" not in r.name)
    return launch_many(todo, parallel=2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(runs, name):
    ref, run = runs["reference"].check(), runs[name].check()
    for key, rtol in (("loss", RTOL), ("grad_norm", GRAD_NORM_RTOL)):
        series = {
            "1 process": {r["step"]: r[key] for r in ref.records()},
            name: {r["step"]: r[key] for r in run.records()},
        }
        assert len(series[name]) == 10
        table, worst = compare(series)
        assert worst[name] <= rtol, f"{key} differs by {worst[name]:.2e}:\n" + "\n".join(table)


def test_zero2_checkpoint_resumes_under_fsdp(runs):
    ref, run = runs["reference"].check(), runs["zero2_to_zero3_resume"].check()
    assert "checkpoint: loaded" in run.output
    series = {"1 process": ref.losses(), "resumed": run.losses()}
    assert sorted(series["resumed"]) == list(range(6, 11))
    series["1 process"] = {k: v for k, v in series["1 process"].items() if k > 5}
    table, worst = compare(series)
    assert worst["resumed"] <= RTOL, "\n".join(table)


def test_compile_time_logged_separately(runs):
    first = runs["fsdp2_compile"].check().records()[0]
    assert first["step"] == 1 and first["compile_time_s"] > 0


def _psi(run: Run) -> int:
    """Parameters of the tiny model, from the rank-0 log line of the run."""
    for line in run.output.splitlines():
        if "parameters," in line and "model llama3" in line:
            return int(line.split("model llama3 debugmodel: ")[1].split(" ")[0].replace(",", ""))
    raise AssertionError("no parameter count in the log:\n" + run.output)


# Bytes per rank after a step, fp32 + Adam, N data-parallel ranks (ZeRO paper, section 5).
ZERO_BYTES = {
    0: lambda psi, n: (4 * psi, 4 * psi, 8 * psi),
    1: lambda psi, n: (4 * psi, 4 * psi, 8 * psi / n),
    2: lambda psi, n: (4 * psi, 4 * psi / n, 8 * psi / n),
    3: lambda psi, n: (4 * psi / n, 4 * psi / n, 8 * psi / n),
}


@pytest.mark.parametrize(
    "name,stage,n",
    [("zero1_4", 1, 4), ("zero2_4", 2, 4), ("zero3_4", 3, 4), ("ddp2_ac_full", 0, 2)],
)
def test_memory_held_matches_zero_formulas(runs, name, stage, n):
    run = runs[name].check()
    (mem,) = run.records("memory")
    psi = _psi(run)
    expected = ZERO_BYTES[stage](psi, n)
    held = [mem[k] * 2**30 for k in ("params_gib", "grads_gib", "optimizer_gib")]
    for what, want, got in zip(("params", "grads", "optimizer"), expected, held):
        # 1%: padding to N rows and Adam's per-parameter step counters.
        assert got == pytest.approx(want, rel=0.01), f"stage {stage} {what}: {got} vs {want}"
