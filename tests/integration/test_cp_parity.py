"""Context parallelism trains exactly like one process: every sequence split over 2 or 4 CP
ranks (load-balanced chunks, global RoPE positions, K/V all-gathered in every layer), alone and
with FSDP, TP and PP, with and without document masking, for Llama and Qwen3, with ZeRO-1/2
for Llama, and for the MoE family twice (CP alone, EP 2 drawn from CP 2 x FSDP 2; PP x CP with
compile and per-op AC at once, and Llama's plain CP 2, are float64 rows of test_fp64_parity.py). The harness of `tests/parity.py`: loss and
gradient norm at every step, final weights, and the layout built (a "cp" mesh dimension, every
block's attention swapped for the context-parallel one, the weights sharded over the
data-parallel and CP ranks together).

Features ride along where they cost no extra launch: gradient accumulation on CP 4, full
activation checkpointing on CP 2 x FSDP 2 (the recomputed forward gathers K/V again), compile
on Qwen3's CP 2 (the gathers inside the compiled blocks). A CP 2 checkpoint resumes bit for bit at CP 2 and reshards to CP 1.

Document masking is proven to be on: its one-process reference trains visibly differently
from the plain one (documents end inside the 32-token windows of the sample corpus).
"""

from __future__ import annotations

import pytest
from parity import (
    CHECKPOINT_ARGS,
    EXACT,
    FP32,
    MOE_FP32,
    QWEN3_COMPILED_CP_FP32,
    QWEN3_FP32,
    RESUME_STEP,
    STEPS,
    Layout,
    assert_layout,
    assert_parity,
    assert_router_parity,
    family_pool_runs,
    final_weights,
    table,
    weight_diff,
)

# Qwen3 reads the corpus in order (the tolerances below were measured on it): in the shuffled
# order a rare token's std-0.02 embedding row, whose gradient is float32 noise, gets Adam steps
# of either sign (final weights 3.1e-2 element-wise, 2.7e-4 norm-wise under CP 2 with
# documents; the same layout in float64 agrees with one process to 1e-10, 2026-12-03).
QWEN3 = ("--model.name=qwen3", "--model.flavor=debugmodel_untied", "--training.shuffle=false")
MOE = ("--model.name=qwen3_moe", "--model.flavor=debugmodel", "--moe.aux_loss_coeff=0.01", "--optimizer.lr=1e-3")  # fmt: skip
DOC = "--training.document_mask=true"

# Global batch 8 sequences everywhere. Every family and shape with and without document
# masking ("_doc"; plain CP attends chunk by chunk without a mask, document masking through
# one), against the one-process run of the family and masking.
# fmt: off
LAYOUTS = table(
    Layout("llama_cp2_doc", 2, ("--parallelism.context_parallel_degree=2", "--training.document_mask=true"), "llama_doc", FP32),
    Layout("llama_cp4_accum", 4, ("--parallelism.context_parallel_degree=4", "--training.local_batch_size=4", "--training.global_batch_size=8"), "llama", FP32),
    Layout("llama_cp4_accum_doc", 4, ("--parallelism.context_parallel_degree=4", "--training.local_batch_size=4", "--training.global_batch_size=8", "--training.document_mask=true"), "llama_doc", FP32),
    Layout("llama_cp2_fsdp2_ac", 4, ("--parallelism.context_parallel_degree=2", "--training.local_batch_size=4", "--activation_checkpoint.mode=full"), "llama", FP32),
    Layout("llama_cp2_fsdp2_ac_doc", 4, ("--parallelism.context_parallel_degree=2", "--training.local_batch_size=4", "--activation_checkpoint.mode=full", "--training.document_mask=true"), "llama_doc", FP32),
    Layout("llama_cp2_tp2", 4, ("--parallelism.context_parallel_degree=2", "--parallelism.tensor_parallel_degree=2"), "llama", FP32),
    Layout("llama_cp2_tp2_doc", 4, ("--parallelism.context_parallel_degree=2", "--parallelism.tensor_parallel_degree=2", "--training.document_mask=true"), "llama_doc", FP32),
    Layout("llama_cp2_pp2", 4, ("--parallelism.context_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2"), "llama", FP32),
    Layout("llama_cp2_pp2_doc", 4, ("--parallelism.context_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2", "--training.document_mask=true"), "llama_doc", FP32),
    # 2 ranks compile: half the gcc work of 4
    Layout("qwen3_cp2", 2, (*QWEN3, "--parallelism.context_parallel_degree=2", "--compile.enable=true"), "qwen3", QWEN3_COMPILED_CP_FP32),
    Layout("qwen3_cp2_doc", 2, (*QWEN3, "--parallelism.context_parallel_degree=2", "--training.document_mask=true"), "qwen3_doc", QWEN3_FP32),
    Layout("qwen3_cp4_accum", 4, (*QWEN3, "--parallelism.context_parallel_degree=4", "--training.local_batch_size=4", "--training.global_batch_size=8"), "qwen3", QWEN3_FP32),
    Layout("qwen3_cp4_accum_doc", 4, (*QWEN3, "--parallelism.context_parallel_degree=4", "--training.local_batch_size=4", "--training.global_batch_size=8", "--training.document_mask=true"), "qwen3_doc", QWEN3_FP32),
    Layout("qwen3_cp2_fsdp2_ac", 4, (*QWEN3, "--parallelism.context_parallel_degree=2", "--training.local_batch_size=4", "--activation_checkpoint.mode=full"), "qwen3", QWEN3_FP32),
    Layout("qwen3_cp2_fsdp2_ac_doc", 4, (*QWEN3, "--parallelism.context_parallel_degree=2", "--training.local_batch_size=4", "--activation_checkpoint.mode=full", "--training.document_mask=true"), "qwen3_doc", QWEN3_FP32),
    Layout("qwen3_cp2_tp2", 4, (*QWEN3, "--parallelism.context_parallel_degree=2", "--parallelism.tensor_parallel_degree=2"), "qwen3", QWEN3_FP32),
    Layout("qwen3_cp2_tp2_doc", 4, (*QWEN3, "--parallelism.context_parallel_degree=2", "--parallelism.tensor_parallel_degree=2", "--training.document_mask=true"), "qwen3_doc", QWEN3_FP32),
    Layout("qwen3_cp2_pp2", 4, (*QWEN3, "--parallelism.context_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2"), "qwen3", QWEN3_FP32),
    Layout("qwen3_cp2_pp2_doc", 4, (*QWEN3, "--parallelism.context_parallel_degree=2", "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2", "--training.document_mask=true"), "qwen3_doc", QWEN3_FP32),
    # ZeRO 0-2 average the gradients (and ZeRO-1/2 shard the masters) over the CP ranks too
    Layout("llama_cp2_zero1", 2, ("--parallelism.context_parallel_degree=2", "--parallelism.zero_stage=1"), "llama", FP32),
    Layout("llama_cp2_zero2_doc", 4, ("--parallelism.context_parallel_degree=2", "--parallelism.zero_stage=2", "--training.local_batch_size=4", DOC), "llama_doc", FP32),
    Layout("moe_cp2_doc", 2, (*MOE, "--parallelism.context_parallel_degree=2", DOC), "moe_doc", MOE_FP32),
    # Every feature at once on 4 ranks (PP x CP, compiled attention inside per-op AC) is the
    # float64 row test_fp64_parity.py[moe_cp2_pp2_compile_ac_op]; plain CP 2 is its llama_cp2.
    # EP 2 drawn from the CP ranks (every CP pair one EP group), the experts FSDP-sharded over
    # the 2 data-parallel ranks: their gradients divided by dp x cp, as the dense weights'
    Layout("moe_ep2_cp2_doc", 4, (*MOE, "--parallelism.context_parallel_degree=2", "--parallelism.expert_parallel_degree=2", "--training.local_batch_size=4", DOC), "moe_doc", MOE_FP32),
)
# resumed from llama_cp2_doc's step-5 checkpoint: the same layout continues exactly, and
# resharded to one process like the one-process run
SAVER = "llama_cp2_doc"
RESUMED = table(
    Layout("llama_cp2_doc_resumed", 2, LAYOUTS[SAVER].args, SAVER, EXACT, after=SAVER),
    Layout("llama_cp2_doc_to_cp1", 1, (DOC,), "llama_doc", FP32, after=SAVER),
)
# fmt: on
REFERENCES = {
    "llama": (),
    "llama_doc": (DOC,),
    "qwen3": QWEN3,
    "qwen3_doc": (*QWEN3, DOC),
    "moe_doc": (*MOE, DOC),
    "moe_z": (*MOE, "--moe.aux_loss_coeff=0", "--moe.z_loss_coeff=0.001"),
}
COMMON = ["--training.steps", str(STEPS), *CHECKPOINT_ARGS]


def pool_runs(selected):
    needs = {
        "test_resume_and_reshard_cp": [*RESUMED, "llama_doc"],
        "test_document_mask_changes_training": ["llama", "llama_doc"],
    }
    return family_pool_runs(selected, COMMON, REFERENCES, LAYOUTS, RESUMED, needs)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_layout_matches_one_process(runs, name):
    row = LAYOUTS[name]
    run, ref = runs[name].check(), runs[row.reference].check()
    # no TP: FSDP (and EP x FSDP) cut every block matrix dp_shard x cp times
    layout = assert_layout(run.folder, run.nproc, run.args)
    if name.startswith("moe"):  # and the expert loads of the global micro-batch, every step
        if "ep2" in name:  # every block's w1, w2, w3 sharded on the expert dimension over "ep"
            for r in layout["ranks"]:
                assert r["placements"]["ep"] == {"Shard(0)": 6}, r["placements"]
        assert_parity(ref.folder, run.folder, row.tol)
        assert_router_parity(ref.folder, run.folder)
    else:
        assert_parity(ref.folder, run.folder, row.tol)


def test_document_mask_changes_training(runs):
    """Document masking is really on in the "_doc" runs: their reference ends elsewhere."""
    plain, masked = runs["llama"].check(), runs["llama_doc"].check()
    d = weight_diff(final_weights(plain.folder), final_weights(masked.folder))
    assert d["max_rel"] > 100 * FP32.weights, d


def test_resume_and_reshard_cp(runs):
    """The CP 2 step-5 checkpoint continues bit for bit at CP 2, and within the parity
    tolerances in one process (CP 1), data position included."""
    for row in RESUMED.values():
        run, ref = runs[row.id].check(), runs[row.reference].check()
        assert "checkpoint: loaded" in run.output, row.id
        assert sorted(run.losses()) == list(range(RESUME_STEP + 1, STEPS + 1)), row.id
        assert_layout(run.folder, row.nproc, run.args)
        assert_parity(ref.folder, run.folder, row.tol, first=RESUME_STEP + 1)
