"""Qwen3, the second family, trains under every layout exactly like one process, tied and
untied: the same harness as Llama's (`tests/parity.py`: loss and gradient norm at every step,
final weights, the layout built), on the tiny shape of `tests/tiny_model.toml` with Qwen3's
QK-norm and a head_dim (32) that is not dim / n_heads (16). Tied: the output projection is the
token embedding matrix, one parameter, under FSDP (one unit), TP (both Shard(0) on the
vocabulary) and TP x FSDP; split by pipeline parallelism, two equal copies (the float64 rows
`qwen3_pp2` and `qwen3_pp2_zbv` in test_fp64_parity.py).
"""

from __future__ import annotations

import pytest
from parity import (
    CHECKPOINT_ARGS,
    QWEN3_FP32,
    RESUME_STEP,
    STEPS,
    Layout,
    assert_layout,
    assert_parity,
    family_pool_runs,
    table,
)

TOL = QWEN3_FP32  # measured: see tests/parity.py

TIED = ("--model.name=qwen3", "--model.flavor=debugmodel")
UNTIED = ("--model.name=qwen3", "--model.flavor=debugmodel_untied")
# In corpus order, the order QWEN3_FP32 was measured on: shuffled, an untied std-0.02 token
# embedding row whose gradient is float32 noise got Adam steps of either sign under TP 2 x
# FSDP 2 (1.2e-2 element-wise, 1.1e-4 norm-wise, 2026-12-03; float64 rows are exact).
COMMON = ["--training.steps", str(STEPS), *CHECKPOINT_ARGS, "--training.shuffle=false"]

# ZeRO 0-2 hold whatever parameters a model has (no family unit, no plan): they are proven on
# Llama (test_parallel_parity.py), not again here.
# fmt: off
LAYOUTS = table(
    Layout("tied_fsdp2", 2, (*TIED, "--training.local_batch_size=4"), "tied", TOL),
    Layout("tied_tp2_fsdp2", 4, (*TIED, "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4"), "tied", TOL),
    Layout("tied_hsdp_2x2", 4, (*TIED, "--parallelism.data_parallel_replicate_degree=2", "--training.local_batch_size=2"), "tied", TOL),
    # replicas only: still FSDP2 (one shard rank), which holds the tied weight; ZeRO-0 cannot
    Layout("tied_hsdp_2x1", 2, (*TIED, "--parallelism.data_parallel_replicate_degree=2", "--training.local_batch_size=4"), "tied", TOL),
    Layout("untied_fsdp2", 2, (*UNTIED, "--training.local_batch_size=4"), "untied", TOL),
    Layout("untied_tp2_fsdp2", 4, (*UNTIED, "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4"), "untied", TOL),
    Layout("untied_pp2", 2, (*UNTIED, "--parallelism.pipeline_parallel_degree=2", "--model.n_layers=4", "--parallelism.pipeline_parallel_schedule=1F1B", "--parallelism.pipeline_parallel_microbatch_size=2"), "untied_4_layers", TOL),
)
# resumed from tied_fsdp2's step-5 checkpoint, resharded (the tied matrix onto the
# vocabulary): like the one-process run (exact resume per layout: test_checkpoint_train.py)
RESUMED = table(
    Layout("tied_fsdp2_to_tp2_fsdp2", 4, LAYOUTS["tied_tp2_fsdp2"].args, "tied", TOL, after="tied_fsdp2"),
)
# fmt: on
REFERENCES = {
    "tied": TIED,
    "untied": UNTIED,
    "untied_4_layers": (*UNTIED, "--model.n_layers=4"),
}


def pool_runs(selected):
    needs = {"test_tied_reference_has_one_matrix": ["tied"], "test_resume_and_reshard": RESUMED}
    return family_pool_runs(selected, COMMON, REFERENCES, LAYOUTS, RESUMED, needs)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qwen3_layout_matches_one_process(runs, name):
    row = LAYOUTS[name]
    run, ref = runs[name].check(), runs[row.reference].check()
    assert_layout(run.folder, run.nproc, run.args)
    assert_parity(ref.folder, run.folder, row.tol)


def test_tied_reference_has_one_matrix(runs):
    """The one-process tied run really trains one matrix: the log counts it once, and its
    checkpoint holds the embedding and output weights equal after 10 steps of training."""
    from parity import final_weights

    run = runs["tied"].check()
    assert run.param_counts()["total"] == 508_352  # by hand: see below
    # embeddings 4096 x 64 + final norm 64 + 2 blocks x (wq 64x128 + wk 64x64 + wv 64x64 +
    # wo 128x64 + 3 x 64x512 + q/k norms 2 x 32 + 2 norms x 64) = 262,144 + 64 + 2 x 123,072
    w = final_weights(run.folder)
    assert (w["output.weight"] == w["tok_embeddings.weight"]).all()


def test_resume_and_reshard(runs):
    """tied_fsdp2's step-5 checkpoint continues within the parity tolerances under TP 2 x
    FSDP 2 (the tied matrix resharded onto the vocabulary)."""
    for row in RESUMED.values():
        run, ref = runs[row.id].check(), runs[row.reference].check()
        assert sorted(run.losses()) == list(range(RESUME_STEP + 1, STEPS + 1)), run.name
        assert_layout(run.folder, run.nproc, run.args)
        assert_parity(ref.folder, run.folder, row.tol, first=RESUME_STEP + 1)
