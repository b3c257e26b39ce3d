"""The combination matrix's committed design (tests/matrix_design.json) with the parity rows it
counts: together they hold every pair of levels that is not refused, and each parity row it
counts is still a row of the parity tables, as it was when the design was drawn. Nothing is
launched: the rows are read from the parity modules' tables through the config parser."""

from __future__ import annotations

from matrix import (
    DESIGN_FILE,
    FACTORS,
    Row,
    degrees,
    launch_of,
    load,
    missing_pairs,
    row_of,
    stale_drawn,
)

DESIGN = load(DESIGN_FILE)
REDRAW = "redraw: ./run_tests.sh --design --write tests/matrix_design.json"


def test_design_and_parity_rows_cover_every_pair():
    missing = missing_pairs(DESIGN)
    assert not missing, f"pairs in no row and not refused ({REDRAW}): {sorted(missing)[:5]}"


def test_counted_parity_rows_are_still_in_the_tables():
    assert DESIGN.drawn, "CI's design counts the parity rows"
    stale = stale_drawn(DESIGN)
    assert not stale, f"parity rows the design counts, changed since ({REDRAW}): {stale[:5]}"


def test_row_of_reads_back_every_row_of_the_design():
    """`row_of` inverts `launch_of`: the mapping of parity rows reads the options as the
    matrix's own launches set them."""
    for row in DESIGN.rows:
        launch = launch_of(row)
        assert row_of(launch.nproc, launch.args, row["relaunch"]) == row, row.label


def _row(**values) -> Row:
    return Row(tuple(values.get(f, levels[0]) for f, levels in FACTORS.items()))


def test_row_of_resolves_degrees_and_refuses_other_levels():
    # the shard degree fills the rest of the world (-1); the accumulation is global / (local x dp)
    ddp_accum = ["--parallelism.zero_stage=0", "--training.local_batch_size=2",
                 "--training.global_batch_size=8"]  # fmt: skip
    assert row_of(2, ddp_accum) == _row(dp="ddp", accum=2)
    assert row_of(4, ddp_accum) is None  # DDP over 4 ranks: not a level of "dp"
    hsdp_tp = ["--parallelism.data_parallel_replicate_degree=2",
               "--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4"]  # fmt: skip
    row = row_of(8, hsdp_tp)  # 8 ranks: more than a matrix row, still its pairs
    assert row == _row(tp=2, dp="hsdp") and degrees(row)["world"] == 8
    qwen3 = ["--model.name=qwen3", "--model.flavor=debugmodel_untied"]
    assert row_of(1, [*qwen3, "--activation_checkpoint.mode=selective"]) == _row(
        model="qwen3", ac="every2"
    )
    assert row_of(1, ["--model.name=qwen3"])["model"] == "qwen3_tied"
    assert row_of(2, ["--compile.enable=true", "--parallelism.tensor_parallel_degree=2"]) == _row(
        tp=2, compile="model+loss"
    )
    for other in (["--training.mixed_precision_param=float64"], ["--model.name=gemma2"],
                  ["--model.flavor=1B"], ["--activation_checkpoint.mode=selective",
                                          "--activation_checkpoint.selective_ac_option=3"]):  # fmt: skip
        assert row_of(2, ["--training.local_batch_size=4", *other]) is None, other


def test_thinning_keeps_every_pair_and_drops_what_others_hold(monkeypatch):
    """`matrix._thinned` on 40 random rows (the config check accepting every row, so that
    nothing is launched or parsed): every pair the rows held is still held, no row got
    dearer, a duplicated row is gone, and so are rows the others already covered."""
    import random

    import matrix

    monkeypatch.setattr(matrix, "refusal", lambda row: "")
    rng = random.Random(5)
    rows = [Row(tuple(rng.choice(levels) for levels in FACTORS.values())) for _ in range(40)]
    rows.append(rows[0])
    thinned = matrix._thinned(list(rows), set())
    assert matrix._covered(thinned) >= matrix._covered(rows)
    assert len(thinned) < len(rows) - 1
    assert sum(map(matrix.cost, thinned)) < sum(map(matrix.cost, rows))
    assert len(set(thinned)) == len(thinned)
