"""Every parallel layout trains the tiny model exactly like one process.

All runs start from the same weights (initialisation is sharding-independent), read the same
global batches (the loader is DP-invariant), run with deterministic algorithms and train
10 steps of the same global batch of 8 sequences. Each run must match its reference (one
process in fp32; FSDP 2 for the bf16 family) under the harness in `tests/parity.py`: loss and
gradient norm (the global norm, clipped to 1.0) at every step, the final weights, and the
layout it built. Runs that add a feature on top of a DP layout (AC modes, accumulation,
offload, compile) check both at once.

Only the runs that the selected tests need are launched (`pytest -k tp2` runs the reference
and `tp2`), which is what lets `tests/mutation/run.py` run one layout per planted bug.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import Run
from parity import (
    CHECKPOINT_ARGS,
    FP32,
    RESUME_STEP,
    STEPS,
    Layout,
    Tolerance,
    assert_layout,
    assert_parity,
    assert_series,
    by_step,
    family_runs,
    final_weights,
    links,
    resumed_runs,
    selected_runs,
    table,
)

from scripts.loss_compare import rel_diff

# tests/tiny_model.toml for 10 steps, saving at steps 5 and 10 (test_checkpoint_train.py
# resumes and reshards these runs' checkpoints; tests/matrix.py reads them too)
COMMON = ["--training.steps", str(STEPS), *CHECKPOINT_ARGS]
BF16 = "--training.mixed_precision_param=bfloat16"
MIX = '--training.mixture=["sample:train:3", "sample:train:1"]'

# bf16 compute with fp32 master weights and fp32 gradient reduction (the GPU default), between
# layouts that all cast the same way (FSDP2's MixedPrecisionPolicy; ZeRO-1/2's bf16 compute
# copies of fp32 master shards). bf16 rounds every matmul input to 8 bits of mantissa and the
# layouts add the bf16 products in different orders, and after 20 Adam steps that shows in the
# weights. Measured worst over the family (2026-12-01, a CPU with avx512_bf16): loss 6.2e-5,
# grad norm 2.5e-4, final weights 7.2e-2 element-wise and 7.0e-3 norm-wise (bf16 against the
# fp32 run: loss 2.4e-4, grad norm 1.2e-3, weights 1.4e-2 norm-wise). Kept at 4x for loss,
# grad norm and norm-wise weights, 3x element-wise: other CPUs run other bf16 kernels.
BF16_TOL = Tolerance(loss=2.5e-4, grad_norm=1e-3, weights=0.2, weights_norm=3e-2)

# Global batch 8 everywhere; AC modes ride along with DP layouts (AC must not change numerics,
# and this also checks ZeRO's parameter swap under recompute).
# fmt: off
TIED_FP32 = dataclasses.replace(FP32, weights=5e-4)  # the tied row: see there
LAYOUTS = table(
    Layout("ddp4_ac_full", 4, ("--parallelism.zero_stage=0", "--training.local_batch_size=2", "--activation_checkpoint.mode=full")),
    Layout("zero1_2_ac_op", 2, ("--parallelism.zero_stage=1", "--training.local_batch_size=4", "--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op")),
    Layout("zero2_2_accum_ac_sel2", 2, ("--parallelism.zero_stage=2", "--training.local_batch_size=2", "--training.global_batch_size=8", "--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2")),
    Layout("zero3_4", 4, ("--parallelism.zero_stage=3", "--training.local_batch_size=2")),
    Layout("hsdp_2x2", 4, ("--parallelism.zero_stage=3", "--training.local_batch_size=2", "--parallelism.data_parallel_replicate_degree=2")),
    Layout("hsdp_2x2_tp2", 8, ("--parallelism.zero_stage=3", "--training.local_batch_size=2", "--parallelism.data_parallel_replicate_degree=2", "--parallelism.tensor_parallel_degree=2")),
    Layout("tp2", 2, ("--parallelism.tensor_parallel_degree=2",)),
    Layout("tp2_fsdp2", 4, ("--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4")),
    Layout("tp2_ddp2_no_loss_parallel", 4, ("--parallelism.zero_stage=0", "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4", "--parallelism.disable_loss_parallel=true")),
    # ZeRO-1/2 split each TP shard's rows over the data-parallel ranks (masters on (dp, tp))
    Layout("tp2_zero1", 4, ("--parallelism.zero_stage=1", "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4")),
    Layout("tp2_zero2_accum", 4, ("--parallelism.zero_stage=2", "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=2", "--training.global_batch_size=8")),
    Layout("fsdp2_offload_accum", 2, ("--training.local_batch_size=2", "--training.global_batch_size=8", "--training.enable_cpu_offload=true")),
    # Compile: TP 2 first, then TP 2 x FSDP 2, which finds the compiled kernels (keyed by their
    # source) in the suite's inductor cache instead of running g++ again on every rank at once
    # (its graphs are its own: keyed by rank and process groups).
    Layout("tp2_compile_ac_op", 2, ("--parallelism.tensor_parallel_degree=2", "--compile.enable=true", "--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op")),
    # AC modes that recompute attention in backward (the flagship presets' TP + compile +
    # full AC): the compiled block saves the CPU RNG state beside its DeviceMesh
    Layout("tp2_compile_ac_full", 2, ("--parallelism.tensor_parallel_degree=2", "--compile.enable=true", "--activation_checkpoint.mode=full")),
    Layout("tp2_compile_ac_sel2", 2, ("--parallelism.tensor_parallel_degree=2", "--compile.enable=true", "--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=2")),
    Layout("tp2_fsdp2_compile", 4, ("--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4", "--compile.enable=true"), after="tp2_compile_ac_op"),
    # the bf16 family, against FSDP 2 in bf16 (itself compared with fp32 only to show that
    # bf16 is in use)
    Layout("fsdp2_bf16", 2, ("--training.local_batch_size=4", BF16), tol=BF16_TOL),
    Layout("zero2_2_accum_bf16", 2, ("--parallelism.zero_stage=2", "--training.local_batch_size=2", "--training.global_batch_size=8", BF16), "fsdp2_bf16", BF16_TOL),
    Layout("tp2_fsdp2_bf16", 4, ("--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4", BF16), "fsdp2_bf16", BF16_TOL),
    # DDP's bf16 compute copies of TP weights: a gradient that comes back in another
    # placement than its weight's (the embedding's) is redistributed before the reduction
    Layout("tp2_ddp2_bf16", 4, ("--parallelism.zero_stage=0", "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4", BF16), "fsdp2_bf16", BF16_TOL),
    # Llama 3.2's tied embeddings (flavor 1B at the tiny shape): one process, then TP 2 x FSDP
    # 2, where TP distributes the two modules' weights and the family ties them again
    Layout("tied_one_process", 1, ("--model.flavor=1B",)),
    # (on an AVX2-only AMD EPYC, 2026-12-07: final weights 2.41e-4 element-wise at
    # layers.0.feed_forward.w3, max abs 1.8e-5, norm-wise 1.3e-5; AVX-512 machines within FP32)
    Layout("tied_tp2_fsdp2", 4, ("--model.flavor=1B", "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4"), "tied_one_process", TIED_FP32),
    # a 3:1 weighted mixture of two differently shuffled views of the corpus (#26): one process,
    # then ZeRO-3 over 4 ranks, each reading only its own rows of the blend
    Layout("mixture_one_process", 1, (MIX,)),
    Layout("mixture_zero3_4", 4, ("--parallelism.zero_stage=3", "--training.local_batch_size=2", MIX), "mixture_one_process"),
)
# ZeRO-2 shards are FSDP's layout (Shard(0), under TP FSDP's shards of the TP shards): their
# step-5 checkpoints resume under ZeRO-3 (`after`: the saver)
RESUMES = table(
    Layout("zero2_to_zero3_resume", 2, ("--parallelism.zero_stage=3", "--training.local_batch_size=4"), after="zero2_2_accum_ac_sel2"),
    Layout("tp2_zero2_to_tp2_fsdp2_resume", 4, ("--parallelism.zero_stage=3", "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4"), after="tp2_zero2_accum"),
)
# fmt: on
BF16_REFERENCE = "fsdp2_bf16"
TIED_REFERENCE = "tied_one_process"
MIX_REFERENCE = "mixture_one_process"
# Tests that need runs besides their parameter's: test name -> runs
NEEDS = {
    "test_compile_time_logged_separately": ["tp2_fsdp2_compile"],
    "test_compile_rerun_on_warm_cache": ["tp2_fsdp2_compile_rerun"],
}
# A restart's view of the compile caches: the same TP 2 x FSDP 2 run again, 4 steps, on the
# cache the first one filled (two TP groups, whose graphs must not be handed to each other).
RERUN_OF = {"tp2_fsdp2_compile_rerun": "tp2_fsdp2_compile"}
RERUN_STEPS = 4


def pool_runs(selected) -> list[Run]:
    """The runs the selected tests need (tests/run_pool.py launches them)."""
    names = {*LAYOUTS, *RESUMES}
    depends = links(LAYOUTS, RESUMES)
    want = {"reference"} | selected_runs(selected, names, NEEDS, *depends, RERUN_OF)
    todo = [Run("reference", 1, COMMON)]
    todo += family_runs(want, COMMON, {}, LAYOUTS)
    todo += resumed_runs(want, COMMON, RESUMES)
    for rerun, first in RERUN_OF.items():
        if rerun in want:
            args = ["--training.steps", str(RERUN_STEPS), *LAYOUTS[first].args]
            todo.append(Run(rerun, LAYOUTS[first].nproc, args, after=first))
    return todo


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(runs, name):
    run = runs[name].check()
    assert_layout(run.folder, run.nproc, run.args)
    row = LAYOUTS[name]
    ref = runs[row.reference].check()
    if name == BF16_REFERENCE:  # bf16 compute really ran: near fp32, but not equal to it
        worst = max(rel_diff(a, b) for a, b in zip(run.losses().values(), ref.losses().values()))
        assert 1e-5 < worst < 5e-2, f"bf16 vs fp32 loss: worst relative difference {worst:.1e}"
        return
    if name == TIED_REFERENCE:  # another model than the reference's: one matrix, still tied
        weights = final_weights(run.folder)
        assert torch.equal(weights["output.weight"], weights["tok_embeddings.weight"])
        # 4096 x 64 embeddings counted once + final norm 64 + 2 blocks x (wq 64x64, wk and wv
        # 64x32, wo 64x64, SwiGLU 3 x 64x256, 2 norms x 64) = 262,144 + 64 + 2 x 61,568
        assert run.param_counts()["total"] == 385_344
        return
    if name == MIX_REFERENCE:  # other data than the reference's: its own tokens per source
        assert run.losses() != ref.losses()
        last = run.records()[-1]
        assert (last["tokens_mix0"], last["tokens_mix1"]) == (6 * 32 * STEPS, 2 * 32 * STEPS)
        return
    assert_parity(ref.folder, run.folder, row.tol)


def test_reference_loss_falls(runs):
    # Otherwise a wrong update could hide in a flat loss curve (8.82 -> 8.13 in 10 steps).
    losses = runs["reference"].check().losses()
    assert len(losses) == STEPS and losses[STEPS] < losses[1] - 0.5, losses


@pytest.mark.parametrize("name", list(RESUMES))
def test_zero2_checkpoint_resumes_under_fsdp(runs, name):
    ref, run = runs["reference"].check(), runs[name].check()
    assert "checkpoint: loaded" in run.output
    assert sorted(run.losses()) == list(range(RESUME_STEP + 1, STEPS + 1))
    assert_layout(run.folder, run.nproc, run.args)
    assert_parity(ref.folder, run.folder, FP32, first=RESUME_STEP + 1)


def test_compile_time_logged_separately(runs):
    first = runs["tp2_fsdp2_compile"].check().records()[0]
    assert first["step"] == 1 and first["compile_time_s"] > 0


def test_compile_rerun_on_warm_cache(runs):
    # Each rank loads the graphs compiled for its own process groups and coordinates, and
    # trains exactly as the first run did.
    first, rerun = runs["tp2_fsdp2_compile"].check(), runs["tp2_fsdp2_compile_rerun"].check()
    for key in ("loss", "grad_norm"):
        want = {s: v for s, v in by_step(first.folder, key).items() if s <= RERUN_STEPS}
        assert_series(want, by_step(rerun.folder, key), key, 0.0)


def _psi(run: Run) -> int:
    """Parameters of the tiny model, from the run's layout.json."""
    return run.param_counts()["total"]


# Bytes per rank after a step, fp32 + Adam, N data-parallel ranks (ZeRO paper, section 5).
ZERO_BYTES = {
    0: lambda psi, n: (4 * psi, 4 * psi, 8 * psi),
    1: lambda psi, n: (4 * psi, 4 * psi, 8 * psi / n),
    2: lambda psi, n: (4 * psi, 4 * psi / n, 8 * psi / n),
    3: lambda psi, n: (4 * psi / n, 4 * psi / n, 8 * psi / n),
}


@pytest.mark.parametrize(
    "name,stage,n",
    [
        ("zero1_2_ac_op", 1, 2),
        ("zero2_2_accum_ac_sel2", 2, 2),
        ("zero3_4", 3, 4),
        ("ddp4_ac_full", 0, 4),
    ],
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
