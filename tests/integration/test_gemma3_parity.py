"""Gemma 3 trains under every layout its features touch exactly like one process: the harness of
`tests/parity.py` (loss and gradient norm at every step, final weights, the layout built) on
the tiny shape of `tests/tiny_model.toml` (2 layers: with the debug flavor's pattern, layer 0
a sliding-window layer and layer 1 a global one; window 16 in 32-token sequences, so the
window cuts every sequence and, under CP, crosses the chunk boundaries).

- FSDP 2: the tied matrix in one unit; the four (1 + w) norms of a block and the QK-norms;
- TP 2 and TP 2 x FSDP 2: the post-attention and post-MLP norms on sequence shards, the
  QK-norms on each rank's heads, the sqrt(dim) scale inside the vocabulary-sharded lookup;
- CP 2 (with and without document masking) and CP 2 x FSDP 2 with full activation
  checkpointing: both attention specs (window, global) through the shared core's CP version,
  each block with the RoPE rows of its kind at the rank's global positions;
- a step-5 FSDP 2 checkpoint resumes bit for bit.
Pipeline parallelism and ZeRO 0-2 refuse tied weights up front (Gemma 3 ties its output).
"""

from __future__ import annotations

import pytest
from parity import (
    CHECKPOINT_ARGS,
    EXACT,
    GEMMA3_FP32,
    RESUME_STEP,
    STEPS,
    Layout,
    assert_layout,
    assert_parity,
    family_pool_runs,
    final_weights,
    table,
    weight_diff,
)

TOL = GEMMA3_FP32  # measured: see tests/parity.py
GEMMA3 = ("--model.name=gemma3", "--model.flavor=debugmodel")
DOC = "--training.document_mask=true"
COMMON = ["--training.steps", str(STEPS), *CHECKPOINT_ARGS]

# fmt: off
LAYOUTS = table(
    Layout("fsdp2", 2, (*GEMMA3, "--training.local_batch_size=4"), "gemma3", TOL),
    Layout("tp2_fsdp2", 4, (*GEMMA3, "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4"), "gemma3", TOL),
    Layout("cp2_doc", 2, (*GEMMA3, "--parallelism.context_parallel_degree=2", DOC), "gemma3_doc", TOL),
    Layout("cp2_fsdp2_ac", 4, (*GEMMA3, "--parallelism.context_parallel_degree=2", "--training.local_batch_size=4", "--activation_checkpoint.mode=full"), "gemma3", TOL),
    Layout("cp2_fsdp2_doc", 4, (*GEMMA3, "--parallelism.context_parallel_degree=2", "--training.local_batch_size=4", DOC), "gemma3_doc", TOL),
    Layout("cp2_tp2", 4, (*GEMMA3, "--parallelism.context_parallel_degree=2", "--parallelism.tensor_parallel_degree=2"), "gemma3", TOL),
)
RESUMED = table(
    Layout("fsdp2_resumed", 2, LAYOUTS["fsdp2"].args, "fsdp2", EXACT, after="fsdp2"),
)
# fmt: on
REFERENCES = {"gemma3": GEMMA3, "gemma3_doc": (*GEMMA3, DOC)}


def pool_runs(selected):
    needs = {
        "test_resume_is_exact": RESUMED,
        "test_document_mask_changes_training": ["gemma3", "gemma3_doc"],
    }
    return family_pool_runs(selected, COMMON, REFERENCES, LAYOUTS, RESUMED, needs)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gemma3_layout_matches_one_process(runs, name):
    row = LAYOUTS[name]
    run, ref = runs[name].check(), runs[row.reference].check()
    assert_layout(run.folder, run.nproc, run.args)
    worst = assert_parity(ref.folder, run.folder, row.tol)
    print(
        f"\n{name}: loss {worst['loss']:.1e} grad norm {worst['grad_norm']:.1e} weights "
        f"{worst['max_rel']:.1e} ({worst['worst']}) norm-wise {worst['max_rel_norm']:.1e}"
    )


def test_document_mask_changes_training(runs):
    """Document masking is really on in the "_doc" runs (documents end inside the 32-token
    sequences), and the reference counts the tied matrix once: embeddings 4096 x 64 + final
    norm 64 + 2 blocks x (wq 64x256 + wk, wv 64x128 + wo 256x64 + 3 x 64x512 + q/k norms 2 x 64
    + 4 norms x 64) = 262,208 + 2 x 147,840."""
    plain, masked = runs["gemma3"].check(), runs["gemma3_doc"].check()
    assert plain.param_counts()["total"] == 557_888
    d = weight_diff(final_weights(plain.folder), final_weights(masked.folder))
    assert d["max_rel"] > 100 * TOL.weights, d


def test_resume_is_exact(runs):
    """The FSDP 2 step-5 checkpoint continues bit for bit."""
    for row in RESUMED.values():
        run, ref = runs[row.id].check(), runs[row.reference].check()
        assert sorted(run.losses()) == list(range(RESUME_STEP + 1, STEPS + 1)), run.name
        assert_layout(run.folder, run.nproc, run.args)
        assert_parity(ref.folder, run.folder, row.tol, first=RESUME_STEP + 1)
