"""The combination matrix: a seeded all-pairs (pairwise covering) design over every option that
changes how a training step is computed, each row a tiny `train.py` run.

Parity tests prove the layouts they name; users run other points of the option space. An
all-pairs design puts every pair of values of every two factors below into at least one row,
so a failure that needs two options together (the common case) shows up in ~40 runs, where
the full product would be millions. The greedy generator (AETG-style) is seeded, so a design is
reproducible, and `./run_tests.sh --matrix SEED` draws and runs another one.

Rows must be accepted by the real config check (`training.preflight.check_config`, in this process, no
process group): the generator asks it about every candidate row, so the design follows the
check and never has to restate its rules. A pair of values that no accepted row can hold is a
*refused pair*; `refused_pairs` reports each with the config check's message for the smallest
row holding it (or the one rule of the generator itself: at most 8 ranks).

The parity tests (tests/integration/*_parity.py) already train many rows of this space against
one process: the generator maps each of their layouts to its factor levels (`row_of`, through
the real config parser) and starts with those rows' pairs covered, so the design adds rows only
for the pairs no parity row holds. The design file records those rows by name (`drawn`), and
a unit test checks that the parity tables still hold them.

    ./run_tests.sh --design --seed 7             # print a design and its refused pairs
    ./run_tests.sh --design --write tests/matrix_design.json  # redraw CI's design (seed 31)
    ./run_tests.sh --design --seed 7 --no-drawn  # a design that counts no parity row
    ./run_tests.sh --matrix 7                    # draw the seed-7 design and run it
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

# factor -> its levels, as they are named in the rows and tables
FACTORS: dict[str, tuple] = {
    "model": ("llama3", "qwen3", "qwen3_tied", "qwen3_moe", "gpt_oss"),
    "tp": (1, 2),
    "pp": ("off", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"),
    "cp": (1, 2),
    "ep": (1, 2),
    # data-parallel kind: none, FSDP 2, HSDP 2x2, replicas only (HSDP with shard degree 1),
    # DDP 2, ZeRO-1 2, ZeRO-2 2
    "dp": ("none", "fsdp", "hsdp", "replicate", "ddp", "zero1", "zero2"),
    "ac": ("none", "full", "every2", "op"),
    "compile": ("off", "model", "loss", "model+loss"),
    "doc_mask": (False, True),
    "precision": ("float32", "bfloat16"),
    "accum": (1, 2),
    "offload": (False, True),
    # Muon with float32 Newton-Schulz: bfloat16's (the default) rounds the layouts' float32
    # reduction-order noise into differences of ~1e-4 by step 4 (grad norm, measured: ZeRO-1
    # with CP 2 5.5e-4); the default is one process = torch.optim.Muon, bit for bit
    "optimizer": ("AdamW", "Muon"),
    # a second launch of the row: none; resumed from its async-saved step-2 checkpoint (steps
    # 3-4 again, exactly); the same run again on the now warm compile cache (exactly equal)
    "relaunch": ("none", "resume_async", "warm_rerun"),
}
DEFAULT_SEED = 31
# the design CI runs (drawn with DEFAULT_SEED); MESHTRAIN_MATRIX_DESIGN names another
TESTS = Path(__file__).resolve().parent
DESIGN_FILE = TESTS / "matrix_design.json"
MAX_RANKS = 4  # the suite runs on 2 cores: 8-rank rows cost 2-3x a 4-rank row
STEPS = 4
GLOBAL_BATCH = 8
SEQ_LEN = 64
N_LAYERS = 4  # the V schedules need 2 stages per rank, one layer each at PP 2
# (replicate, shard, zero stage) of each data-parallel kind
DP_KINDS = {
    "none": (1, 1, 3),
    "fsdp": (1, 2, 3),
    "hsdp": (2, 2, 3),
    "replicate": (2, 1, 3),
    "ddp": (1, 2, 0),
    "zero1": (1, 2, 1),
    "zero2": (1, 2, 2),
}
FAMILY_ARGS = {
    "llama3": [],
    "qwen3": ["--model.name", "qwen3", "--model.flavor", "debugmodel_untied"],
    "qwen3_tied": ["--model.name", "qwen3", "--model.flavor", "debugmodel"],
    # the per-token z-loss and the bias balancing, not the load-balancing loss: that one is
    # over each micro-batch, which PP and accumulation cut differently from one process
    "qwen3_moe": ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel",
                  "--moe.aux_loss_coeff", "0", "--moe.z_loss_coeff", "0.001",
                  "--moe.bias_update_rate", "0.001", "--optimizer.lr", "1e-3"],
    # sinks, a 16-token window on every other layer, YaRN, biased clamped-SwiGLU experts
    "gpt_oss": ["--model.name", "gpt_oss", "--model.flavor", "debugmodel",
                "--moe.aux_loss_coeff", "0", "--moe.z_loss_coeff", "0.001",
                "--moe.bias_update_rate", "0.001", "--optimizer.lr", "1e-3"],
}  # fmt: skip
# what every run shares: the tiny shape (tests/tiny_model.toml) at 4 layers, 4 steps of the
# same 8 sequences of 64 tokens per step
COMMON = ["--model.n_layers", str(N_LAYERS), "--training.seq_len", str(SEQ_LEN),
          "--training.steps", str(STEPS), "--training.global_batch_size", str(GLOBAL_BATCH),
          "--debug.deterministic", "true"]  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One point of the option space: a value for every factor."""

    values: tuple  # in FACTORS order

    def __getitem__(self, factor: str):
        return self.values[list(FACTORS).index(factor)]

    def pairs(self) -> set[tuple]:
        items = list(zip(FACTORS, self.values))
        return {(a, b) for a, b in itertools.combinations(items, 2)}

    @property
    def label(self) -> str:
        """The non-default values, e.g. 'qwen3_moe tp2 pp=1F1B ac=op'."""
        parts = [str(self["model"])]
        for factor, value in zip(FACTORS, self.values):
            if factor != "model" and value != FACTORS[factor][0]:
                parts.append(f"{factor}{value}" if isinstance(value, int) else f"{factor}={value}")
        return " ".join(parts)


@dataclass
class Launch:
    """What one row runs: ranks and train.py arguments, and the reference it must match."""

    nproc: int
    args: list[str]
    reference: str  # the one-process run of the same model, masking and precision
    reference_args: list[str] = field(default_factory=list)


def degrees(row: Row) -> dict[str, int]:
    rep, shard, zero = DP_KINDS[row["dp"]]
    pp = 1 if row["pp"] == "off" else 2
    world = row["tp"] * pp * row["cp"] * rep * shard
    return {"replicate": rep, "shard": shard, "zero": zero, "pp": pp, "world": world}


def reference_name(row: Row) -> str:
    return (f"ref_{row['model']}_{row['precision']}" + ("_doc" if row["doc_mask"] else "")
            + ("_muon" if row["optimizer"] == "Muon" else ""))  # fmt: skip


def optimizer_args(row: Row) -> list[str]:
    if row["optimizer"] == "Muon":
        return ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"]
    return []


def reference_args(row: Row) -> list[str]:
    """One process, same model, data, masking and precision (and the same 8 sequences a step:
    the layout, accumulation and everything else must not change the numbers)."""
    return [*COMMON, *FAMILY_ARGS[row["model"]], "--training.local_batch_size", str(GLOBAL_BATCH),
            "--training.document_mask", str(row["doc_mask"]).lower(),
            "--training.mixed_precision_param", row["precision"],
            *optimizer_args(row)]  # fmt: skip


def launch_of(row: Row) -> Launch:
    d = degrees(row)
    dp = d["replicate"] * d["shard"]
    local = GLOBAL_BATCH // (dp * row["accum"])
    a = [*COMMON, *FAMILY_ARGS[row["model"]], "--training.local_batch_size", str(local),
         "--training.document_mask", str(row["doc_mask"]).lower(),
         "--training.mixed_precision_param", row["precision"],
         "--parallelism.data_parallel_replicate_degree", str(d["replicate"]),
         "--parallelism.data_parallel_shard_degree", str(d["shard"]),
         "--parallelism.zero_stage", str(d["zero"]),
         "--parallelism.tensor_parallel_degree", str(row["tp"]),
         "--parallelism.context_parallel_degree", str(row["cp"]),
         "--parallelism.expert_parallel_degree", str(row["ep"]),
         "--parallelism.pipeline_parallel_degree", str(d["pp"]), *optimizer_args(row)]  # fmt: skip
    if d["pp"] > 1:
        a += ["--parallelism.pipeline_parallel_schedule", row["pp"]]
    ac = {"none": ("none", "2"), "full": ("full", "2"), "every2": ("selective", "2"),
          "op": ("selective", "op")}[row["ac"]]  # fmt: skip
    a += ["--activation_checkpoint.mode", ac[0], "--activation_checkpoint.selective_ac_option",
          ac[1]]  # fmt: skip
    if row["compile"] != "off":
        a += ["--compile.enable", "true", "--compile.components", row["compile"].replace("+", ",")]
    if row["offload"]:
        a += ["--training.enable_cpu_offload", "true"]
    if row["relaunch"] == "resume_async":
        a += ["--checkpoint.enable", "true", "--checkpoint.interval", "2",
              "--checkpoint.async_mode", "async"]  # fmt: skip
    return Launch(d["world"], _drop_defaults(a), reference_name(row), reference_args(row))


def _drop_defaults(args: list[str]) -> list[str]:
    """Leaves out the options a row sets to the value they would have anyway (a degree of 1,
    ZeRO-3, no AC), so that the unused-option check sees only what the row asks for."""
    defaults = {
        "--parallelism.data_parallel_replicate_degree": "1",
        "--parallelism.tensor_parallel_degree": "1",
        "--parallelism.context_parallel_degree": "1",
        "--parallelism.expert_parallel_degree": "1",
        "--parallelism.pipeline_parallel_degree": "1",
        "--parallelism.zero_stage": "3",
        "--activation_checkpoint.mode": "none",
        "--training.document_mask": "false",
        "--training.mixed_precision_param": "float32",
    }
    out, i = [], 0
    while i < len(args):
        key, value = args[i], args[i + 1]
        if defaults.get(key) == value:
            i += 2
            continue
        if key == "--activation_checkpoint.selective_ac_option" and "selective" not in args:
            i += 2
            continue
        out += [key, value]
        i += 2
    return out


# --- the rows the parity tests already run ---------------------------------------------------

# The modules (tests/integration) whose layouts count as rows: each checks every layout against
# a one-process run (or a run it must repeat exactly), as the matrix checks its rows. Not the
# presets (test_presets.py), which check only that the loss falls and the layout is built.
PARITY_MODULES = ("test_parallel_parity", "test_pipeline_parity", "test_qwen3_parity",
                  "test_moe_parity", "test_cp_parity", "test_gemma2_parity",
                  "test_gemma3_parity", "test_fp64_parity", "test_muon_parity")  # fmt: skip
# the tables of rows resumed from their `after` run's checkpoint (parity.resumed_runs)
RESUMED_TABLES = ("RESUMES", "RESUMED")


def _config(args: Sequence[str]):
    """The config of train.py with `args` over tests/tiny_model.toml (no cross-field check)."""
    from dist_utils import TINY_CONFIG

    from job_config import parse_args

    return parse_args(["--config", str(TINY_CONFIG), *args], check=False)


def _family(cfg) -> tuple[str, bool]:
    """(model name, whether the output projection is the embedding matrix) of a config."""
    from models import model_args_for

    args = model_args_for(cfg, cfg.training.seq_len, None)
    return cfg.model.name, bool(getattr(args, "tie_embeddings", False))


@cache
def _model_levels() -> dict[tuple[str, bool], str]:
    return {_family(_config(FAMILY_ARGS[level])): level for level in FACTORS["model"]}


def row_of(nproc: int, args: Sequence[str], relaunch: str = "none") -> Row | None:
    """The row a launch runs: `nproc` ranks of train.py with `args` over tests/tiny_model.toml,
    read from the config the real parser builds, its degrees resolved by `ParallelDims` for
    the world size as train.py resolves them (the shard degree -1 fills the rest). None where
    a value is no level of its factor: float64, Gemma or a tied Llama, a degree, DP kind or
    accumulation that the factors do not list (CP 4, DDP 4, ZeRO-1 over CP ranks only), another
    schedule or AC option. The world size itself is not limited: the pairs still train together.
    `relaunch`: the row's second launch, which the arguments do not show."""
    from parallelisms.parallel_dims import ParallelDims

    cfg = _config(args)
    dims = ParallelDims.from_parallelism(cfg.parallelism, nproc)
    t, ac, comp = cfg.training, cfg.activation_checkpoint, cfg.compile
    if dims.pp == 1:
        schedule = "off"
    else:
        schedule = cfg.parallelism.pipeline_parallel_schedule if dims.pp == 2 else None
    if ac.mode == "selective":
        ac_level = {"op": "op", "2": "every2"}.get(ac.selective_ac_option)
    else:
        ac_level = ac.mode
    compiled = "+".join(c for c in ("model", "loss") if c in comp.components)
    if set(comp.components) - {"model", "loss"}:
        compiled = None
    dp_kinds = {shape: kind for kind, shape in DP_KINDS.items()}
    global_batch = t.global_batch_size
    per_micro = t.local_batch_size * dims.dp
    values = {
        "model": _model_levels().get(_family(cfg)),
        "tp": dims.tp,
        "pp": schedule,
        "cp": dims.cp,
        "ep": dims.ep,
        "dp": dp_kinds.get((dims.dp_replicate, dims.dp_shard, dims.zero_stage)),
        "ac": ac_level,
        "compile": compiled if comp.enable else "off",
        "doc_mask": t.document_mask,
        "precision": t.mixed_precision_param,
        "accum": 1 if global_batch == -1 else global_batch // per_micro,
        "offload": t.enable_cpu_offload,
        "optimizer": {("AdamW", "bfloat16"): "AdamW", ("Muon", "float32"): "Muon"}.get(
            (cfg.optimizer.name, cfg.optimizer.muon_ns_dtype)
        ),
        "relaunch": relaunch,
    }
    if any(values[f] not in levels for f, levels in FACTORS.items()):
        return None
    return Row(tuple(values[f] for f in FACTORS))


def _tables(module) -> dict[str, dict]:
    """A parity module's tables of layouts (`parity.table`'s dicts), by name."""
    from parity import Layout

    return {
        name: value
        for name, value in vars(module).items()
        if isinstance(value, dict) and value and all(isinstance(v, Layout) for v in value.values())
    }


def _parity_module(name: str):
    """tests/integration/NAME.py, loaded from its file once (the module pytest imported, when
    pytest did): its own imports (`parity`, `dist_utils`) come from tests/, which is on the path
    both under pytest (pyproject's `pythonpath`) and when this file runs as a script."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TESTS / "integration" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def drawn_rows() -> list[tuple[str, Row]]:
    """("module::id", row) of every layout of the parity modules that is a row (`row_of`), in
    the modules' order: each module's layouts on top of its `COMMON` arguments; its resumed
    rows (relaunch "resume_async" where the saver, in the same row, saved async: the matrix's
    exact resume); its warm-cache reruns (`RERUN_OF`: "warm_rerun"). Left out: the rows a
    module names `*_REFERENCE`, which its tests compare with nothing one-process (the bf16
    family's reference, say), and the one-process references (nothing checks them)."""
    out = []
    for name in PARITY_MODULES:
        module = _parity_module(name)
        common = [str(a) for a in module.COMMON]
        references = {v for k, v in vars(module).items() if k.endswith("_REFERENCE")
                      and isinstance(v, str)}  # fmt: skip
        tables = _tables(module)
        layouts = {i: row for table in tables.values() for i, row in table.items()}

        def launch(layout, relaunch="none", common=common):
            return row_of(layout.nproc, [*common, *layout.args], relaunch)

        for table_name, table in tables.items():
            for i, layout in table.items():
                if i in references:
                    continue
                relaunch = "none"
                if table_name in RESUMED_TABLES:
                    saver = layouts[layout.after]
                    saved_async = _config([*common, *saver.args]).checkpoint.async_mode
                    if saved_async != "disabled" and launch(saver) == launch(layout):
                        relaunch = "resume_async"
                row = launch(layout, relaunch)
                if row is not None:
                    out.append((f"{name}::{i}", row))
        for rerun, first in getattr(module, "RERUN_OF", {}).items():
            row = launch(layouts[first], "warm_rerun")
            if row is not None:
                out.append((f"{name}::{rerun}", row))
    return out


@cache
def refusal(row: Row) -> str:
    """'' when the config check accepts the row at its world size, else its message."""
    d = degrees(row)
    if d["world"] > MAX_RANKS:
        return f"needs {d['world']} ranks (the matrix runs at most {MAX_RANKS})"
    from dist_utils import TINY_CONFIG

    from job_config import ConfigError, parse_args
    from parallelisms.parallel_dims import ParallelismError
    from training.preflight import check_config

    try:
        cfg = parse_args(["--config", str(TINY_CONFIG), *launch_of(row).args])
        check_config(cfg, d["world"])
    except (ConfigError, ParallelismError) as e:
        return str(e)
    return ""


def _all_pairs() -> set[tuple]:
    items = [[(f, v) for v in levels] for f, levels in FACTORS.items()]
    return {(a, b) for x, y in itertools.combinations(items, 2) for a in x for b in y}


def _complete(fixed: dict, uncovered: set, rng: random.Random) -> Row:
    """A row holding `fixed`, the other factors chosen one by one (in random order) for the
    most still-uncovered pairs with the values chosen so far."""
    values = dict(fixed)
    for factor in rng.sample(list(FACTORS), len(FACTORS)):
        if factor in values:
            continue

        def gain(level, factor=factor):
            return sum(
                ((f, v), (factor, level)) in uncovered or ((factor, level), (f, v)) in uncovered
                for f, v in values.items()
            )

        # ties go to the earlier level: each factor lists its cheapest (off, none, 1) first
        levels = FACTORS[factor]
        values[factor] = max(levels, key=lambda level: (gain(level), -levels.index(level)))
    return Row(tuple(values[f] for f in FACTORS))


def cost(row: Row) -> float:
    """A row's launch time in units of one uncompiled rank, as measured on the 2-core machine
    (seed-23 design, 2026-12-02: 4 ranks 10.6 s, compiled 45 s, compiled and relaunched
    79-89 s): the design's generator spends it where it covers the most new pairs."""
    compiled = 4.3 if row["compile"] != "off" else 1.0
    relaunched = 1.8 if row["relaunch"] != "none" else 1.0
    return degrees(row)["world"] * compiled * relaunched


def _repair(row: Row, keep: set, rng: random.Random, tries: int) -> Row | None:
    """`row` or a neighbour of it (other values for factors outside `keep`) that the config
    check accepts; None if `tries` random changes find none."""
    for _ in range(tries):
        if not refusal(row):
            return row
        factor = rng.choice([f for f in FACTORS if f not in keep])
        values = list(row.values)
        values[list(FACTORS).index(factor)] = rng.choice(FACTORS[factor])
        row = Row(tuple(values))
    return row if not refusal(row) else None


@dataclass
class Design:
    seed: int
    rows: list[Row]
    refused: dict[tuple, str]  # pair -> why no accepted row can hold it
    # the parity rows whose pairs the design counts as covered: ("module::id", row)
    drawn: list[tuple[str, Row]] = field(default_factory=list)


def generate(
    seed: int = DEFAULT_SEED,
    candidates: int = 12,
    tries: int = 40,
    drawn: list[tuple[str, Row]] | None = None,
) -> Design:
    """The seeded all-pairs design: rows until every pair is in a row, in a `drawn` row (the
    parity tests' rows, `drawn_rows()`, unless given; [] for a design of its own) or found
    refused."""
    drawn = drawn_rows() if drawn is None else list(drawn)
    rng = random.Random(seed)
    order = sorted(_all_pairs(), key=repr)
    rng.shuffle(order)
    uncovered = _all_pairs() - _covered(row for _, row in drawn)
    rows, refused = [], {}
    for target in order:
        if target not in uncovered:
            continue
        fixed = dict(target)
        best, best_key = None, None
        tried = [_complete(fixed, uncovered, rng) for _ in range(candidates)]
        for row in [_repair(r, set(fixed), rng, tries) for r in tried] + [_smallest(target)]:
            if row is None or refusal(row) or target not in row.pairs():
                continue
            # new pairs per unit of launch time
            key = len(row.pairs() & uncovered) / cost(row)
            if best_key is None or key > best_key:
                best, best_key = row, key
        if best is None:
            refused[target] = _why_refused(target)
            uncovered.discard(target)
            continue
        rows.append(best)
        uncovered -= best.pairs()
    return Design(seed, _thinned(rows, _covered(row for _, row in drawn)), refused, drawn)


def _thinned(rows: list[Row], drawn: set[tuple]) -> list[Row]:
    """`rows` less the rows whose pairs the others (and the `drawn` pairs) already hold, or
    can be made to hold: the greedy draw's later rows often cover an early row's pairs but one
    or two, and those fit into another row by setting the pair's two factors there (a row
    accepted by the config check, no dearer, that keeps every pair only it held). The
    dearest rows go first; repeated until no row can go. Every pair the rows held stays held."""
    needed = _covered(rows) - drawn

    def rehomed(rest: list[Row], lost: set[tuple]) -> list[Row] | None:
        for pair in sorted(lost, key=repr):
            if pair in _covered(rest):
                continue
            for k in sorted(range(len(rest)), key=lambda k: cost(rest[k])):
                values = dict(zip(FACTORS, rest[k].values)) | dict(pair)
                moved = Row(tuple(values[f] for f in FACTORS))
                if moved == rest[k] or cost(moved) > cost(rest[k]):
                    continue
                trial = [*rest[:k], moved, *rest[k + 1 :]]
                if not (needed - lost) - _covered(trial) and not refusal(moved):
                    rest = trial
                    break
            else:
                return None
        return rest

    thinned = True
    while thinned:
        thinned = False
        for row in sorted(rows, key=cost, reverse=True):
            rest = [r for r in rows if r is not row]
            rest = rehomed(rest, needed - _covered(rest))
            if rest is not None:
                rows, thinned = rest, True
                break
    return rows


def _covered(rows) -> set[tuple]:
    return set().union(*(row.pairs() for row in rows))


def missing_pairs(design: Design) -> set[tuple]:
    """The pairs in no row of the design nor of its drawn parity rows, and not refused."""
    rows = [*design.rows, *(row for _, row in design.drawn)]
    return _all_pairs() - _covered(rows) - set(design.refused)


def stale_drawn(design: Design) -> list[str]:
    """The design's drawn parity rows that the parity tables no longer hold as they were
    (removed, renamed, or another row now): the design must be redrawn."""
    now = dict(drawn_rows())
    return [
        f"{name}: drawn as {row.label}, now "
        + (now[name].label if now.get(name) else "not a row of the tables")
        for name, row in design.drawn
        if now.get(name) != row
    ]


def _smallest(pair: tuple) -> Row:
    """The row holding `pair` with every other factor at its first level; the model and the
    data parallelism that the pair needs (experts and shard ranks for EP) where it names none."""
    values = {f: levels[0] for f, levels in FACTORS.items()} | dict(pair)
    if values["ep"] != 1 and "model" not in dict(pair):
        values["model"] = "qwen3_moe"
    if values["ep"] != 1 and "dp" not in dict(pair):
        values["dp"] = "fsdp"  # EP ranks are drawn from the FSDP shard ranks
    if degrees(Row(tuple(values[f] for f in FACTORS)))["world"] == 1:
        # one rank alone is the reference, not a row: 2 ranks of a factor the pair leaves free
        factor, level = next(
            x for x in (("dp", "fsdp"), ("tp", 2), ("cp", 2)) if x[0] not in dict(pair)
        )
        values[factor] = level
    return Row(tuple(values[f] for f in FACTORS))


def _why_refused(pair: tuple) -> str:
    """The config check's message for the smallest row holding `pair`."""
    return refusal(_smallest(pair)) or "accepted alone; refused with every completion tried"


def describe(design: Design) -> str:
    total = sum(cost(row) for row in design.rows)
    lines = [f"combination matrix, seed {design.seed}: {len(design.rows)} rows, estimated cost "
             f"{total:.0f} (matrix.cost), besides {len(design.drawn)} parity rows"]  # fmt: skip
    for i, row in enumerate(design.rows):
        lines.append(f"  {i:02d} ({degrees(row)['world']} ranks) {row.label}")
    lines.append(f"refused pairs: {len(design.refused)}")
    for (a, b), why in sorted(design.refused.items(), key=repr):
        why = " ".join(line.strip() for line in why.splitlines())
        lines.append(f"  {a[0]}={a[1]} + {b[0]}={b[1]}: {why}")
    return "\n".join(lines)


def save(design: Design, path: Path) -> None:
    data = {
        "seed": design.seed,
        "factors": list(FACTORS),
        "rows": [list(r.values) for r in design.rows],
        "refused": [[list(a), list(b), why] for (a, b), why in design.refused.items()],
        "drawn": [[name, list(row.values)] for name, row in design.drawn],
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


def load(path: Path = DESIGN_FILE) -> Design:
    """A design written by `save` (the CI design by default: generating one asks the config
    check about thousands of candidate rows, a minute or more, too long for every collection)."""
    data = json.loads(Path(path).read_text())
    assert data["factors"] == list(FACTORS), f"{path} was drawn over other factors: regenerate it"
    rows = [Row(tuple(v)) for v in data["rows"]]
    refused = {(tuple(a), tuple(b)): why for a, b, why in data["refused"]}
    drawn = [(name, Row(tuple(v))) for name, v in data.get("drawn", [])]
    return Design(data["seed"], rows, refused, drawn)


def table(report: Path) -> str:
    """A markdown table of a run's report (MESHTRAIN_MATRIX_REPORT's JSON lines)."""
    lines = ["| row | ranks | options (other than the first level of each factor) | outcome | "
             "step-1 loss | step-1 grad norm | worst loss | worst grad norm | s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    records = sorted(
        (json.loads(x) for x in report.read_text().splitlines()), key=lambda r: r["row"]
    )
    for r in records:
        nums = [f"{r[k]:.1e}" if k in r else "" for k in
                ("step1_loss", "step1_grad_norm", "loss", "grad_norm")]  # fmt: skip
        lines.append(f"| {r['row']} | {r['ranks']} | {r['label']} | {r['outcome']} | "
                     + " | ".join(nums) + f" | {r.get('seconds', '')} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--write", type=Path, help="save the design (JSON) to this file")
    parser.add_argument("--table", type=Path, help="print a run's report as a markdown table")
    parser.add_argument("--no-drawn", action="store_true",
                        help="count no parity row: a design that covers every pair itself")  # fmt: skip
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table))
        return
    design = generate(args.seed, drawn=[] if args.no_drawn else None)
    print(describe(design))
    if args.write:
        save(design, args.write)


if __name__ == "__main__":
    main()
