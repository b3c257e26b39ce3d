"""In the float64 mode (`training.mixed_precision_param = "float64"`: weights, compute,
gradient reductions and optimizer state in float64) every layout of every family trains like
one process to near machine precision: loss and gradient norm at every step and the final
weights within `parity.FP64` (1e-10 relative), and the layout built as asked.

Why a float64 family beside the float32 ones: float32 tolerances are measured noise, and some
architectures amplify that noise far more than Llama does, so a float32 difference cannot tell
a layout bug from noise in a new family. In float64 the noise is ~1e-13, so anything above
1e-10 is a bug. Mixture of experts: routing is discrete, and in float32 a near tie can send a
token to another expert in another layout; in float64 no tie flips, so the expert loads of
every step must agree exactly too (`assert_router_parity` at the same tolerance).

Cheap by design: the tiny shape of `tests/tiny_model.toml`, 8 steps, 2 ranks except one
4-rank composition per family that needs it.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import launch_many
from parity import (
    CHECKPOINT_ARGS,
    FP64,
    assert_layout,
    assert_parity,
    assert_router_parity,
    family_runs,
    final_weights,
    moe_local_blocks,
    selected_runs,
)

STEPS = 8  # the checkpoint of the last step holds the final weights
COMMON = ["--training.steps", str(STEPS), *CHECKPOINT_ARGS,
          "--training.mixed_precision_param", "float64"]  # fmt: skip
LB, GB = ["--training.local_batch_size"], ["--training.global_batch_size"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
       "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "2"]  # fmt: skip
CP2 = ["--parallelism.context_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
ZERO0 = ["--parallelism.zero_stage", "0"]
MOE = ["--model.name", "qwen3_moe", "--optimizer.lr", "1e-3"]  # lr: see test_moe_parity.py
# PP splits a rank's batch into microbatches, each with its own load-balancing loss, so the
# PP run and its reference use the per-token z-loss and the bias balancing instead
Z_BIAS = ["--model.moe_aux_loss_coeff", "0", "--model.moe_z_loss_coeff", "0.001",
          "--model.moe_bias_update_rate", "0.001"]  # fmt: skip

# reference (one process): arguments
REFERENCES = {
    "llama": [],
    "qwen3": ["--model.name", "qwen3"],  # tied embeddings, QK-norm
    "moe": [*MOE, "--model.moe_aux_loss_coeff", "0.01"],
    "moe_z_bias": [*MOE, *Z_BIAS],
}


def on(ref: str, ranks: int, *layout: str) -> tuple[int, list[str], str]:
    """A layout of `ref`'s model and options: (ranks, arguments, reference)."""
    return ranks, [*REFERENCES[ref], *layout], ref


# name: (ranks, arguments, reference); global batch 8 sequences everywhere
LAYOUTS = {
    "llama_fsdp2": on("llama", 2, *LB, "4"),
    "llama_zero2_accum": on("llama", 2, "--parallelism.zero_stage", "2", *LB, "2", *GB, "8"),
    "llama_tp2_fsdp2": on("llama", 4, *TP2, *LB, "4"),
    "llama_pp2": on("llama", 2, *PP2),
    "llama_cp2": on("llama", 2, *CP2),
    "qwen3_fsdp2": on("qwen3", 2, *LB, "4"),
    "qwen3_tp2": on("qwen3", 2, *TP2),
    "moe_ep2": on("moe", 2, *EP2, *LB, "4"),
    "moe_ep2_pp2": on("moe_z_bias", 4, *EP2, *PP2, *LB, "4"),
    # DDP's experts average over fewer ranks than they divide by (EP ranks hold the sum over
    # the EP group's tokens): reduced once per step, after accumulation or the schedule
    "moe_ep2_ddp_accum": on("moe_z_bias", 2, *EP2, *ZERO0, *LB, "2", *GB, "8"),
    "moe_ep2_pp2_ddp": on("moe_z_bias", 4, *EP2, *PP2, *ZERO0, *LB, "4"),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    base = tmp_path_factory.mktemp("fp64_parity")
    refs = {name: ref for name, (_, _, ref) in LAYOUTS.items()}
    want = selected_runs(request, LAYOUTS, {}, refs)
    widest_first = sorted(
        family_runs(base, want, COMMON, REFERENCES, LAYOUTS), key=lambda r: -r.nproc
    )
    return launch_many(widest_first, parallel=2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp64_layout_matches_one_process(runs, name):
    ranks, _, reference = LAYOUTS[name]
    run, ref = runs[name].check(), runs[reference].check()
    assert_layout(run.folder, ranks, run.args, 2, moe_local_blocks(ranks, run.args, 2))
    weights = final_weights(run.folder, STEPS)
    assert {w.dtype for w in weights.values()} == {torch.float64}, "not float64 weights"
    worst = assert_parity(ref.folder, run.folder, FP64, step=STEPS)
    if name.startswith("moe"):  # no tie flips: the same tokens per expert at every step
        assert_router_parity(ref.folder, run.folder, tol=FP64.loss)
    print(
        f"\n{name}: loss {worst['loss']:.1e} grad norm {worst['grad_norm']:.1e} weights "
        f"{worst['max_rel']:.1e} ({worst['worst']}) norm-wise {worst['max_rel_norm']:.1e}"
    )
