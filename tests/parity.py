"""The parity harness: what "this layout trains exactly like one process" means, in one place.

A parity check compares two runs of the same global batches and initial weights:
- the loss and the gradient norm at every step (relative difference);
- the full trained parameters, read from each run's final DCP checkpoint into this process
  (DCP gathers every rank's shards): max abs difference and max difference relative to the
  tensor's largest value;
- the layout the run really built (`<dump>/layout.json`, read from the built mesh, parameter
  placements, wrappers and stages) against the layout the test asked for, including the
  per-rank parameter elements the sharding implies (a TP-2 run holds half the block weights).

Tolerances, measured on the 2-core development machine (fp32, deterministic algorithms,
20 steps at lr 3e-3), with the worst layout's value and the margin kept. The runs are 10 steps
since 2026-12-08 (the suite's budget, #31): float32 noise grows with the steps, so the bounds
measured over 20 hold over the first 10 with more margin, and every planted bug of the
mutation check is still caught:
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from dist_utils import Run, read_records

from scripts.loss_compare import compare, read_metric

STEPS = 10
RESUME_STEP = 5  # the resume tests start from this step's checkpoint
# Saves at RESUME_STEP and at the last step (the final weights).
CHECKPOINT_ARGS = ["--checkpoint.enable", "true", "--checkpoint.interval", str(RESUME_STEP)]


@dataclass(frozen=True)
class Tolerance:
    loss: float  # relative, per step
    grad_norm: float  # relative, per step
    weights: float  # max |a - b| / max |b| per tensor, on the final parameters
    weights_norm: float  # ||a - b|| / ||b|| per tensor, on the final parameters


# fp32: layouts only reorder float32 reductions. Measured worst over the 20 DP/TP/compile
# layouts (2026-12-01): loss 2.2e-7, grad norm 5.0e-5 (the one-process fp32 norm of the
# 4096 x 64 output-projection gradient is itself ~3e-5 off the float64 value; sharded layouts
# sum smaller pieces), final weights 4.1e-5 element-wise (Adam turns a 1e-7 gradient
# difference on a near-zero element into a visible step) and 5.3e-6 norm-wise. Kept at about
# 45x / 2x / 5x / 10x that; the planted bugs of tests/mutation/run.py move them by 1e-3.
FP32 = Tolerance(loss=1e-5, grad_norm=1e-4, weights=2e-4, weights_norm=5e-5)
# Qwen3: the fp32 tolerances, except element-wise on the final weights: Qwen3's embeddings
# start at std 0.02 (Llama's at 1.0), so the same absolute noise is a larger share of the
# tensor's largest value. Measured (2026-12-01): untied token embeddings 1.5e-3 element-wise
# (max abs 1.3e-4) under TP 2 x FSDP 2, 1.1e-3 under FSDP 2 / ZeRO-1 / ZeRO-2, 2.9e-4 under
# PP 2; norm-wise at most 1.4e-5, within FP32's 5e-5; loss 2.3e-7, grad norm 2.1e-5. Kept at 3x.
QWEN3_FP32 = dataclasses.replace(FP32, weights=5e-3)
# Qwen3 under CP with compiled blocks: grouped-query attention reads K/V at their own size
# (SDPA's enable_gqa), which compiles to another float32 summation order than eager. Measured
# (2026-12-02, 20 steps): final weights 5.25e-3 element-wise and 5.01e-5 norm-wise, the token
# embeddings (std 0.02) again; loss and grad norm within FP32. The same layout in float64
# (test_fp64_parity.py[qwen3_cp2_compile]) agrees with one process to 1e-10, so this is
# float32 noise, not the layout. Kept at 2x.
QWEN3_COMPILED_CP_FP32 = dataclasses.replace(QWEN3_FP32, weights=1e-2, weights_norm=1e-4)
# Gemma 2 (tests/integration/test_gemma2_parity.py): the fp32 tolerances, except element-wise
# on the final weights, whose matrices start at std 0.02 as Qwen3's. Measured (2026-12-02, 20
# steps, 6 layouts and 2 resumed): final weights 2.6e-4 element-wise under TP 2 and TP 2 x
# FSDP 2 (layer 0's w1, max abs 2.4e-5; 7.0e-5 and below under FSDP 2 and CP), norm-wise
# 1.1e-5; loss 2.5e-7, grad norm 2.5e-5. Kept at about 4x for the weights.
GEMMA2_FP32 = dataclasses.replace(FP32, weights=1e-3)
# Gemma 3 (tests/integration/test_gemma3_parity.py): the fp32 tolerances, except the gradient
# norm and the final weights element-wise. Measured (2026-12-02, 20 steps, FSDP 2, TP 2,
# TP 2 x FSDP 2, CP 2, CP 2 with documents, CP 2 x FSDP 2 with AC): loss 2.3e-7; grad norm
# 1.7e-4, all at step 19, where every layout agrees with the others to 2e-5 and the one-process
# reference is the one apart (its norm jumps 1.05 -> 1.37 there; 1e-5 at the other steps);
# final weights 4.6e-4 element-wise (layers.0.feed_forward.w2 under TP 2: std-0.02 matrices as
# Qwen3's) and 1.7e-5 norm-wise. The float64 rows (test_fp64_parity.py[gemma3_*]) agree with
# one process to 1e-10, so this is float32 noise. Kept at about 3x / 4x that.
GEMMA3_FP32 = dataclasses.replace(FP32, grad_norm=5e-4, weights=2e-3)
# Qwen3-MoE (tests/integration/test_moe_parity.py, test_cp_parity.py). # Routing is discrete: a token whose top-2 choice is a near tie (the router starts near
# uniform, std-0.02 weights) can pick another expert in another layout on a 1e-7 difference.
# Measured (2026-12-01, 20 steps, lr 1e-3), without such a flip: loss 2.3e-7, grad norm
# 1.4e-4 (PP 2 x EP 2; 1.7e-5 for the others), final weights 5.0e-3 element-wise (of the
# tensor's largest value: a rare token's embedding row under PP 2 x EP 2, max abs 3.2e-4;
# std-0.02 embeddings as Qwen3's; 1.3e-3 elsewhere), 3.2e-5 norm-wise.
# One flip in the 20th step of EP 2 x FSDP 2 with the bias: loss 5.1e-6, grad norm 5.3e-5, the
# layer's router 1.8e-4 norm-wise. Kept at about 4x / 2x / 4x / 5x that. The planted bugs of
# tests/mutation/run.py move the grad norm by 1e-3 or more from the first step.
MOE_FP32 = dataclasses.replace(FP32, loss=2e-5, grad_norm=3e-4, weights=2e-2, weights_norm=1e-3)
# relative, per step, on the loads and the aux loss: measured 2e-6 without a flip; one
# token's choice moves the load of its two experts by 1/64 (256 tokens x 2 over 8 experts)
ROUTER_TOL = 2e-2
# float64 (`training.mixed_precision_param = "float64"`, tests/integration/test_fp64_parity.py):
# weights, compute, reductions and optimizer state in float64, so layouts differ only by the
# order of float64 additions; every family (Llama, Qwen3, Gemma 3, Qwen3-MoE) against one
# process. Measured worst over the 9 layouts (2026-12-02, 8 steps): loss 4.4e-16 (Qwen3
# FSDP 2), grad norm 2.9e-15, final weights 6.5e-13 element-wise (Llama TP 2 x FSDP 2, wv) and
# 4.4e-14 norm-wise; the router loads equal. Gemma 3's TP 2 and CP 2 rows (2026-12-02): loss
# 4.4e-16, grad norm 2.8e-15, final weights 2.8e-12 element-wise (CP 2, layers.0 w2: std-0.02
# matrices) and 7.2e-14 norm-wise. Kept at 1e-10, over 30x that: one float32 rounding
# anywhere (~1e-7), or one token routed to another expert, is far above it.
FP64 = Tolerance(loss=1e-10, grad_norm=1e-10, weights=1e-10, weights_norm=1e-10)
# Exact resume: the same layout continues bit for bit.
EXACT = Tolerance(loss=0.0, grad_norm=0.0, weights=0.0, weights_norm=0.0)


@dataclass(frozen=True)
class Layout:
    """One row of a parity table: `nproc` ranks of train.py with `args`, plain
    `--section.key=value` overrides on top of the test file's common arguments, that must train
    like the run `reference` within `tol`, and build the layout `args` ask for
    (`expected_layout`). `after`: the run this one waits for (the saver of the checkpoint it
    resumes from, or the run whose compile cache it finds warm)."""

    id: str  # the pytest parameter id
    nproc: int
    args: tuple[str, ...] = ()
    reference: str = "reference"
    tol: Tolerance = FP32
    after: str | None = None

    def __post_init__(self):
        plain = all(a.startswith("--") and "=" in a for a in self.args)
        assert isinstance(self.args, tuple) and plain, f"{self.id}: not --section.key=value"


def table(*rows: Layout) -> dict[str, Layout]:
    """A test file's layouts by id, in the order given; every id once."""
    out = {row.id: row for row in rows}
    assert len(out) == len(rows), f"an id repeats in {[row.id for row in rows]}"
    return out


def links(*tables: dict[str, Layout]) -> tuple[dict[str, str], dict[str, str]]:
    """What the rows need besides themselves, for `selected_runs`: {id: reference} and
    {id: after}."""
    rows = [row for rows in tables for row in rows.values()]
    return {r.id: r.reference for r in rows}, {r.id: r.after for r in rows if r.after}


def assert_series(ref: dict[int, float], got: dict[int, float], what: str, tol: float) -> float:
    """Every step of `ref` is in `got` within relative `tol`; returns the worst difference."""
    table, worst = compare({"reference": ref, "run": got})
    assert sorted(got) == sorted(ref), f"{what}: steps {sorted(got)} vs {sorted(ref)}"
    assert worst["run"] <= tol, f"{what} differs by {worst['run']:.2e} (tolerance {tol:.0e}):\n" + (
        "\n".join(table)
    )
    return worst["run"]


def by_step(folder: Path, key: str, kind: str = "train", first: int = 1) -> dict[int, float]:
    """`key` per step from `metrics.jsonl` (a resumed run appends: its latest record of a step
    wins), from step `first` on."""
    return {s: v for s, v in read_metric(folder, key, kind).items() if s >= first}


def final_weights(folder: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    from checkpoint.hf import read_dcp_model

    return read_dcp_model(Path(folder) / "checkpoint" / f"step-{step}")


def weight_diff(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict:
    """Element-wise comparison of two full state dicts: max abs diff, max diff relative to each
    tensor's largest magnitude (and the tensor where it is worst), max norm-wise relative diff."""
    assert sorted(ref) == sorted(got), f"parameter names differ: {sorted(set(ref) ^ set(got))}"
    out = {"max_abs": 0.0, "max_rel": 0.0, "worst": "", "max_rel_norm": 0.0}
    for name, want in ref.items():
        have, want = got[name].double(), want.double()
        assert have.shape == want.shape, f"{name}: shape {tuple(have.shape)} vs {tuple(want.shape)}"
        diff = (have - want).abs()
        rel = diff.max().item() / max(want.abs().max().item(), 1e-30)
        out["max_abs"] = max(out["max_abs"], diff.max().item())
        norm = diff.norm().item() / max(want.norm().item(), 1e-30)
        out["max_rel_norm"] = max(out["max_rel_norm"], norm)
        if rel >= out["max_rel"]:
            out.update(max_rel=rel, worst=name)
    return out


def assert_weights(ref_folder: Path, folder: Path, tol: Tolerance, step: int = STEPS) -> dict:
    d = weight_diff(final_weights(ref_folder, step), final_weights(folder, step))
    assert d["max_rel"] <= tol.weights and d["max_rel_norm"] <= tol.weights_norm, (
        f"final weights differ: max rel {d['max_rel']:.2e} at {d['worst']} (tolerance "
        f"{tol.weights:.0e}), norm-wise {d['max_rel_norm']:.2e} (tolerance "
        f"{tol.weights_norm:.0e}), max abs {d['max_abs']:.2e}"
    )
    return d


def assert_parity(ref: Path, run: Path, tol: Tolerance, *, first: int = 1, step: int = STEPS):
    """Loss and gradient norm at every step from `first`, then the final weights; returns the
    worst differences seen (loss, grad_norm and `weight_diff`'s)."""
    worst = {}
    for key, t in (("loss", tol.loss), ("grad_norm", tol.grad_norm)):
        ours, theirs = by_step(ref, key, first=first), by_step(run, key, first=first)
        worst[key] = assert_series(ours, theirs, key, t)
    return worst | assert_weights(ref, run, tol, step)


# --- which runs the selected tests need ------------------------------------------------------


def selected_runs(selected, names, needs: dict, *depends: dict) -> set[str]:
    """The runs that the `selected` test items (of one module) need: their parameters that
    name a run in `names`, `needs[test name]`, and everything those depend on through the
    `depends` maps (run -> run it needs). So `pytest -k NAME` launches only what NAME needs."""
    want = set()
    for item in selected:
        callspec = getattr(item, "callspec", None)
        want |= {v for v in (callspec.params.values() if callspec else ()) if v in names}
        want |= set(needs.get(item.originalname, ()))
    while True:
        more = {d.get(w) for d in depends for w in want} - {None}
        if more <= want:
            return want
        want |= more


def family_runs(want: set[str], common: list[str], references: dict, layouts: dict,
                **run) -> list[Run]:  # fmt: skip
    """The runs of `want`: one-process references (name: arguments) and layouts (id: `Layout`),
    each with the `common` arguments first; `run`: more `Run` fields for the layouts (env)."""
    todo = [Run(n, 1, [*common, *a]) for n, a in references.items() if n in want]
    todo += [
        Run(n, row.nproc, [*common, *row.args], after=row.after, **run)
        for n, row in layouts.items()
        if n in want
    ]
    return todo


def resumed_runs(want: set[str], common: list[str], rows: dict) -> list[Run]:
    """The runs of `want` among `rows` (id: `Layout`), each resumed from the RESUME_STEP
    checkpoint of its `after` run (optimizer included)."""
    todo = []
    for n, row in rows.items():
        if n in want:
            load = [f"--checkpoint.initial_load_path={{run:{row.after}}}/checkpoint/step-{RESUME_STEP}",
                    "--checkpoint.initial_load_model_only=false"]  # fmt: skip
            todo.append(Run(n, row.nproc, [*common, *row.args, *load], after=row.after))
    return todo


def family_pool_runs(
    selected,
    common: list[str],
    references: dict,
    layouts: dict,
    resumed: dict | None = None,
    needs: dict | None = None,
    **run,
) -> list[Run]:
    """A family parity module's runs (its `pool_runs`): those its selected tests need
    (`selected_runs`; `needs`: test name -> runs), the one-process references, the layouts and
    the `resumed` rows; `run`: more `Run` fields for the layouts."""
    resumed = resumed or {}
    want = selected_runs(selected, layouts, needs or {}, *links(layouts, resumed))
    return family_runs(want, common, references, layouts, **run) + resumed_runs(
        want, common, resumed
    )


# --- the layout a run must have built -------------------------------------------------------


def options(args: list[str]) -> dict[str, str]:
    """`--section.key value` and `--section.key=value` options of a train.py command line, by
    `section.key` (the last one wins)."""
    out, i = {}, 0
    while i < len(args):
        key = args[i]
        if key.startswith("--") and "=" in key:
            k, v = key[2:].split("=", 1)
            out[k], i = v, i + 1
        elif key.startswith("--"):
            out[key[2:]], i = args[i + 1], i + 2
        else:
            i += 1
    return out


def _divides(index: int, every: int) -> bool:
    return (index + 1) % every == 0


def expected_layout(nproc: int, args: list[str], n_layers: int = 2) -> dict:
    """What a run with these arguments must build, derived from the arguments alone."""
    o = options(args)
    n_layers = int(o.get("model.n_layers", n_layers))
    tp = int(o.get("parallelism.tensor_parallel_degree", 1))
    pp = int(o.get("parallelism.pipeline_parallel_degree", 1))
    rep = int(o.get("parallelism.data_parallel_replicate_degree", 1))
    ep = int(o.get("parallelism.expert_parallel_degree", 1))
    cp = int(o.get("parallelism.context_parallel_degree", 1))
    shard = nproc // (tp * pp * rep * cp)
    # under EP the shard ranks are built as (dp_shard_mod_ep, ep), or with CP as
    # (dp_shard_mod_ep, dp_shard_in_ep) with "ep" the flattened (dp_shard_in_ep, cp): see
    # parallel_dims.py
    shard_dims = (("dp_shard", shard),)
    if ep > 1:
        inner = "dp_shard_in_ep" if cp > 1 else "ep"
        shard_dims = (("dp_shard_mod_ep", shard // (ep // cp)), (inner, ep // cp))
    stage = int(o.get("parallelism.zero_stage", 3))
    # FSDP shards over the data-parallel and CP ranks together ("dp_shard_cp")
    # (replicas only, shard * cp == 1, is still FSDP: HSDP over one shard rank)
    if rep * shard * cp == 1:
        dp = {"kind": "none", "zero_stage": None}
    elif stage < 3:
        dp = {"kind": "zero", "zero_stage": stage}
    else:
        dp = {"kind": "fsdp", "zero_stage": 3}
    schedule = o.get("parallelism.pipeline_parallel_schedule", "1F1B") if pp > 1 else None
    multi = schedule is not None and schedule.lower() not in ("1f1b", "gpipe")
    ac, sac = (
        o.get("activation_checkpoint.mode", "none"),
        o.get("activation_checkpoint.selective_ac_option", "2"),
    )
    return {
        "world_size": nproc,
        "mesh": {
            n: d
            for n, d in (("pp", pp), ("dp_replicate", rep), *shard_dims, ("cp", cp), ("tp", tp))
            if d > 1
        },
        "schedule": schedule,
        "stages_per_rank": (2 if multi else 1),
        "layers_per_rank": n_layers // pp
        if "parallelism.pipeline_parallel_split_points" not in o
        else None,
        "n_layers": n_layers,
        "data_parallel": dp,
        # how many times the block weights are cut on each rank
        "block_divisor": tp * (shard * cp if dp["zero_stage"] in (1, 2, 3) else 1),
        "context_parallel": cp > 1,
        "context_parallel_method": o.get("parallelism.context_parallel_method", "allgather"),
        "ac": ac,
        "ac_every": None if ac != "selective" or sac == "op" else int(sac),
        "ac_op": ac == "selective" and sac == "op",
        "compiled": o.get("compile.enable", "false") == "true"
        and "model" in o.get("compile.components", "model"),
    }


def assert_layout(
    folder: Path, nproc: int, args: list[str], n_layers: int = 2, local_blocks=None
) -> dict:
    """The run's `layout.json` matches what `args` asked for (see `expected_layout`).
    `local_blocks`: the block weight elements each rank must hold, where the family's layout
    does not cut every block matrix tp x shard times (experts are not TP-sharded)."""
    want = expected_layout(nproc, args, n_layers)
    got = json.loads((Path(folder) / "layout.json").read_text())
    assert got["world_size"] == want["world_size"], got["world_size"]
    assert got["mesh"] == want["mesh"], f"built mesh {got['mesh']}, asked for {want['mesh']}"
    if want["schedule"] is None:
        assert got["pipeline_schedule"] is None, got["pipeline_schedule"]
    else:
        name = (got["pipeline_schedule"] or "").lower()
        assert name == "schedule" + want["schedule"].lower(), (name, want["schedule"])
    all_layers = set()
    for r in got["ranks"]:
        where = f"rank {r['rank']}"
        dp = {k: r["data_parallel"][k] for k in ("kind", "zero_stage")}
        assert dp == want["data_parallel"], f"{where}: data parallel {dp} vs {want}"
        if want["schedule"] is not None:
            assert r["stages"] == want["stages_per_rank"], f"{where}: {r['stages']} stages"
        if want["layers_per_rank"] is not None:
            assert len(r["layers"]) == want["layers_per_rank"], f"{where}: {r['layers']}"
        all_layers |= set(r["layers"])
        # the sharding the layout implies: every block matrix cut tp x (ZeRO-1..3 shards)
        n = r["numel"]
        expected = n["global_blocks_2d"] // want["block_divisor"]
        expected = local_blocks if local_blocks is not None else expected
        assert n["local_blocks_2d"] == expected, (
            f"{where}: holds {n['local_blocks_2d']} of {n['global_blocks_2d']} block weight "
            f"elements, expected {expected}"
        )
        if "tp" in want["mesh"]:
            assert r["placements"]["tp"].get("Shard(0)", 0) > 0, r["placements"]
        layers = [int(k) for k in r["layers"]]
        ac = {
            "none": [],
            "full": layers,
            "selective": [i for i in layers if want["ac_op"] or _divides(i, want["ac_every"] or 1)],
        }[want["ac"]]
        assert sorted(int(k) for k in r["ac_blocks"]) == sorted(ac), f"{where}: {r['ac_blocks']}"
        op = sorted(layers) if want["ac_op"] else []
        assert sorted(int(k) for k in r["ac_selective_op_blocks"]) == op, where
        compiled = sorted(layers) if want["compiled"] else []
        assert sorted(int(k) for k in r["compiled_blocks"]) == compiled, f"{where}: compile"
        cp_blocks = sorted(layers) if want["context_parallel"] else []
        assert sorted(int(k) for k in r["context_parallel_blocks"]) == cp_blocks, f"{where}: CP"
        method = [want["context_parallel_method"]] if cp_blocks else []
        assert r["context_parallel_method"] == method, f"{where}: CP method"
    assert all_layers == {str(i) for i in range(want["n_layers"])}, sorted(all_layers)
    return got


# The 2-D (and more) weight elements of one MoE block's 8 experts at the tiny width (dim 64,
# expert width 128): Qwen3-MoE's w1 / w2 / w3; gpt-oss's gate_up_proj [8, 64, 256] and its
# bias [8, 256], down_proj [8, 128, 64] and its bias [8, 64]
MOE_EXPERT_ELEMENTS = {
    "qwen3_moe": 3 * 8 * 128 * 64,
    "gpt_oss": 8 * (64 * 256 + 256 + 128 * 64 + 64),
}


def moe_local_blocks(nproc: int, args: list[str], n_layers: int) -> int | None:
    """Block weight elements per rank of an MoE debug flavor at the tiny width (dim 64): the
    attention matrices cut TP x shard times, the router and the experts (never TP-sharded) by
    the shard ranks only. None for the dense families, where `expected_layout`'s rule holds."""
    o = options(args)
    family = next((f for f in MOE_EXPERT_ELEMENTS if f in args), o.get("model.name"))
    if family == "deepseek_v3" and int(o.get("parallelism.tensor_parallel_degree", 1)) > 1:
        return _latent_attention_local_blocks(nproc, args, n_layers)
    if family not in MOE_EXPERT_ELEMENTS:
        return None
    tp = int(o.get("parallelism.tensor_parallel_degree", 1))
    shards = expected_layout(nproc, args, n_layers)["block_divisor"] // tp
    layers = n_layers // int(o.get("parallelism.pipeline_parallel_degree", 1))
    attention = 64 * 128 * 2 + 64 * 64 * 2  # wq, wo (4 heads x 32) and wk, wv (2 kv heads)
    router, experts = 8 * 64, MOE_EXPERT_ELEMENTS[family]
    ep = int(o.get("parallelism.expert_parallel_degree", 1))
    # the experts are split over the EP ranks even where nothing else is sharded (ZeRO-0);
    # the router is replicated over them
    return layers * (attention // (tp * shards) + router // shards + experts // max(shards, ep))


# DeepSeek-V3's block matrices that TP leaves whole (the rest of its blocks' matrices are cut
# over the heads or the SwiGLU's hidden units; the routed experts over EP)
_TP_REPLICATED = ("attention.wq_a.", "attention.wkv_a.", "moe.router.", "moe.shared_experts.")


def _latent_attention_local_blocks(nproc: int, args: list[str], n_layers: int) -> int:
    """Block weight elements per rank of DeepSeek-V3 under TP (no PP), from its meta model:
    the heads' projections and the dense SwiGLU cut TP x shard times, the replicated
    bottlenecks, router and shared experts by the shard ranks, the routed experts by
    max(shard, EP) ranks."""
    from dist_utils import TINY_CONFIG

    from job_config import parse_args
    from models import meta_model_for

    o = options(args)
    assert int(o.get("parallelism.pipeline_parallel_degree", 1)) == 1, "every rank all blocks"
    tp = int(o.get("parallelism.tensor_parallel_degree", 1))
    shards = expected_layout(nproc, args, n_layers)["block_divisor"] // tp
    ep = int(o.get("parallelism.expert_parallel_degree", 1))
    cfg = parse_args(["--config", str(TINY_CONFIG), *args])
    _, _, model = meta_model_for(cfg, cfg.training.seq_len, None, ValueError)
    total = 0
    for name, p in model.layers.named_parameters():
        if p.ndim < 2:
            continue
        if ".moe.experts." in name:
            total += p.numel() // max(shards, ep)
        elif any(part in name for part in _TP_REPLICATED):
            total += p.numel() // shards
        else:
            total += p.numel() // (tp * shards)
    return total


def assert_router_parity(ref, run, first: int = 1, tol: float = ROUTER_TOL) -> None:
    """The expert loads and the load-balancing loss of every step equal the reference's."""
    for key in ("max_load", "min_load", "aux_loss", "bias_drift"):
        want = {r["step"]: r[key] for r in read_records(ref, "router") if r["step"] >= first}
        got = {r["step"]: r[key] for r in read_records(run, "router") if r["step"] >= first}
        assert_series(want, got, f"router {key}", tol)
