"""Context parallelism trains exactly like one process: every sequence split over 2 or 4 CP
ranks (load-balanced chunks, global RoPE positions, K/V all-gathered in every layer), alone and
with FSDP, TP and PP, with and without document masking, for Llama and Qwen3, with ZeRO-1/2
for Llama, and for the MoE family three times (CP alone, EP 2 drawn from CP 2 x FSDP 2, and
PP x CP with compile and per-op AC at once). The harness of `tests/parity.py`: loss and
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
from dist_utils import Run, launch_many
from parity import (
    CHECKPOINT_ARGS,
    EXACT,
    FP32,
    MOE_FP32,
    QWEN3_FP32,
    STEPS,
    assert_layout,
    assert_parity,
    assert_router_parity,
    final_weights,
    selected_runs,
    weight_diff,
)

FAMILIES = {
    "llama": [],
    "qwen3": ["--model.name", "qwen3", "--model.flavor", "debugmodel_untied"],
}
TOLERANCE = {"llama": FP32, "qwen3": QWEN3_FP32}
DOC = ["--training.document_mask", "true"]
LB, GB = "--training.local_batch_size", "--training.global_batch_size"
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
       "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "2"]  # fmt: skip
AC_FULL = ["--activation_checkpoint.mode", "full"]
COMPILE = ["--compile.enable", "true"]


def cp(n: int) -> list[str]:
    return ["--parallelism.context_parallel_degree", str(n)]


# layout: (ranks, arguments); global batch 8 sequences everywhere
SHAPES = {
    "cp2": (2, cp(2)),
    "cp4_accum": (4, [*cp(4), LB, "4", GB, "8"]),
    "cp2_fsdp2_ac": (4, [*cp(2), LB, "4", *AC_FULL]),
    "cp2_tp2": (4, [*cp(2), *TP2]),
    "cp2_pp2": (4, [*cp(2), *PP2]),
}
# name -> (ranks, arguments, reference): every family and shape, with and without document
# masking (plain CP attends chunk by chunk without a mask, document masking through one)
LAYOUTS = {
    f"{family}_{shape}{doc}": (n, [*FAMILIES[family], *args, *(DOC if doc else [])], family + doc)
    for family in FAMILIES
    for shape, (n, args) in SHAPES.items()
    for doc in ("", "_doc")
}
LAYOUTS["qwen3_cp2"][1].extend(COMPILE)  # 2 ranks compile: half the gcc work of 4
# ZeRO 0-2 average the gradients (and ZeRO-1/2 shard the masters) over the CP ranks too
ZERO = "--parallelism.zero_stage"
LAYOUTS["llama_cp2_zero1"] = (2, [*cp(2), ZERO, "1"], "llama")
LAYOUTS["llama_cp2_zero2_doc"] = (4, [*cp(2), ZERO, "2", LB, "4", *DOC], "llama_doc")
MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel",
       "--model.moe_aux_loss_coeff", "0.01", "--optimizer.lr", "1e-3"]  # fmt: skip
LAYOUTS["moe_cp2_doc"] = (2, [*MOE, *cp(2), *DOC], "moe_doc")
# Every feature at once on 4 ranks: PP x CP, compile (the MoE blocks' attention, so the K/V
# gathers run in a compiled region inside an eager per-op checkpoint) and per-op AC. The
# load-balancing loss is off (under PP it is taken over a pipeline microbatch, not the
# reference's batch); the per-token z-loss instead.
Z_LOSS = ["--model.moe_aux_loss_coeff", "0", "--model.moe_z_loss_coeff", "0.001"]
AC_OP = ["--activation_checkpoint.mode", "selective",
         "--activation_checkpoint.selective_ac_option", "op"]  # fmt: skip
LAYOUTS["moe_cp2_pp2_compile_ac_op"] = (4, [*MOE, *Z_LOSS, *cp(2), *PP2, *COMPILE, *AC_OP],
                                        "moe_z")  # fmt: skip
# EP 2 drawn from the CP ranks (every CP pair one EP group), the experts FSDP-sharded over the
# 2 data-parallel ranks: their gradients divided by dp x cp, as the dense weights'
EP2 = ["--parallelism.expert_parallel_degree", "2"]
LAYOUTS["moe_ep2_cp2_doc"] = (4, [*MOE, *cp(2), *EP2, LB, "4", *DOC], "moe_doc")
REFERENCES = {f"{f}{d}": [*args, *(DOC if d else [])] for f, args in FAMILIES.items()
              for d in ("", "_doc")}  # fmt: skip
REFERENCES["moe_doc"] = [*MOE, *DOC]
REFERENCES["moe_z"] = [*MOE, *Z_LOSS]
# resumed from llama_cp2_doc's step-10 checkpoint: name -> (ranks, layout arguments)
SAVER = "llama_cp2_doc"
RESUMED = {
    "llama_cp2_doc_resumed": (2, LAYOUTS[SAVER][1]),  # the same layout: exact
    "llama_cp2_doc_to_cp1": (1, DOC),  # resharded to one process
}
COMMON = ["--training.steps", str(STEPS), *CHECKPOINT_ARGS]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    base = tmp_path_factory.mktemp("cp_parity")
    refs = {name: ref for name, (_, _, ref) in LAYOUTS.items()}
    refs |= {name: SAVER for name in RESUMED}
    needs = {
        "test_resume_and_reshard_cp": [*RESUMED, "llama_doc"],
        "test_document_mask_changes_training": ["llama", "llama_doc"],
    }
    want = selected_runs(request, LAYOUTS, needs, refs, {SAVER: "llama_doc"})
    env = {"TORCHINDUCTOR_CACHE_DIR": str(base / "inductor_cache")}  # see test_parallel_parity
    todo = [Run(n, base / n, 1, COMMON + a) for n, a in REFERENCES.items() if n in want]
    todo += [
        Run(n, base / n, k, COMMON + a, env=env) for n, (k, a, _) in LAYOUTS.items() if n in want
    ]
    load = ["--checkpoint.initial_load_path", str(base / SAVER / "checkpoint" / "step-10")]
    load += ["--checkpoint.initial_load_model_only", "false"]
    todo += [
        Run(n, base / n, k, COMMON + a + load, after=SAVER)
        for n, (k, a) in RESUMED.items()
        if n in want
    ]
    todo.sort(key=lambda r: ("compile" not in " ".join(r.args), -r.nproc))
    return launch_many(todo, parallel=2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_layout_matches_one_process(runs, name):
    run, ref = runs[name].check(), runs[LAYOUTS[name][2]].check()
    # no TP: FSDP (and EP x FSDP) cut every block matrix dp_shard x cp times
    layout = assert_layout(run.folder, run.nproc, run.args)
    if name.startswith("moe"):  # and the expert loads of the global micro-batch, every step
        if "ep2" in name:  # every block's w1, w2, w3 sharded on the expert dimension over "ep"
            for r in layout["ranks"]:
                assert r["placements"]["ep"] == {"Shard(0)": 6}, r["placements"]
        assert_parity(ref.folder, run.folder, MOE_FP32)
        assert_router_parity(ref.folder, run.folder)
    else:
        assert_parity(ref.folder, run.folder, TOLERANCE[name.split("_")[0]])


def test_document_mask_changes_training(runs):
    """Document masking is really on in the "_doc" runs: their reference ends elsewhere."""
    plain, masked = runs["llama"].check(), runs["llama_doc"].check()
    d = weight_diff(final_weights(plain.folder), final_weights(masked.folder))
    assert d["max_rel"] > 100 * FP32.weights, d


def test_resume_and_reshard_cp(runs):
    """The CP 2 step-10 checkpoint continues bit for bit at CP 2, and within the parity
    tolerances in one process (CP 1), data position included."""
    saver, ref = runs[SAVER].check(), runs["llama_doc"].check()
    for name, (nproc, _) in RESUMED.items():
        run = runs[name].check()
        assert "checkpoint: loaded" in run.output, name
        assert sorted(run.losses()) == list(range(11, STEPS + 1)), name
        assert_layout(run.folder, nproc, run.args)
        exact = name.endswith("_resumed")
        assert_parity(saver.folder if exact else ref.folder, run.folder, EXACT if exact else FP32,
                      first=11)  # fmt: skip
