"""The run pool's keys (tests/run_pool.py), without launching anything: which declarations
are one run, which are not, and where a run that starts from another finds it."""

from __future__ import annotations

from dist_utils import Run
from run_pool import Pool


def _pool(tmp_path, **modules) -> Pool:
    pool = Pool(tmp_path / "pool")
    for module, runs in modules.items():
        pool.declare(module, runs)
    return pool


def test_one_resolved_config_is_one_run_whatever_its_spelling(tmp_path):
    pool = _pool(
        tmp_path,
        a=[Run("ref", 1, ["--training.steps", "20"])],
        # `=` form, and the default zero stage written out
        b=[Run("reference", 1, ["--training.steps=20", "--parallelism.zero_stage=3"])],
        c=[Run("other", 2, ["--training.steps=20"])],  # other ranks
        d=[Run("longer", 1, ["--training.steps=21"])],  # another config
    )
    assert len(pool.entries) == 3 and pool.declared == 4
    assert pool.modules["a"]["ref"] == pool.modules["b"]["reference"]
    shared = pool.entries[pool.modules["a"]["ref"]]
    assert shared.users == [("a", "ref"), ("b", "reference")]


def test_environment_and_what_a_run_starts_from_are_part_of_its_key(tmp_path):
    args = ["--training.steps=4"]
    pool = _pool(
        tmp_path,
        m=[
            Run("first", 1, args),
            Run("again", 1, args, after="first"),  # a rerun: its own launch
            Run("env", 1, args, env={"X": "1"}),
            Run("copy", 1, args, copy_from=("first", "checkpoint/step-2")),
            Run("load", 1, [*args, "--checkpoint.initial_load_path={run:first}/checkpoint"]),
        ],
    )
    keys = pool.modules["m"]
    assert len(set(keys.values())) == 5
    first = pool.entries[keys["first"]]
    assert pool.entries[keys["again"]].deps == {first.key}
    copy = pool.entries[keys["copy"]].copy
    assert copy == (first.run.folder / "checkpoint/step-2", pool.entries[keys["copy"]].run.folder
                    / "checkpoint/step-2")  # fmt: skip
    load = pool.entries[keys["load"]].run
    assert f"--checkpoint.initial_load_path={first.run.folder}/checkpoint" in load.args


def test_a_run_started_from_a_shared_run_finds_its_folder(tmp_path):
    """Module b names module a's run otherwise: b's resumed run reads a's folder."""
    pool = _pool(
        tmp_path,
        a=[Run("reference", 1, ["--training.steps=20"])],
        b=[
            Run("ref_single", 1, ["--training.steps", "20"]),
            Run("resumed", 1, ["--training.steps=20"], copy_from=("ref_single", "checkpoint")),
        ],
    )
    source = pool.entries[pool.modules["a"]["reference"]].run.folder
    resumed = pool.entries[pool.modules["b"]["resumed"]]
    assert resumed.copy[0] == source / "checkpoint"
    view = pool._view("b", "ref_single", pool.entries[pool.modules["b"]["ref_single"]])
    assert view.folder == source and view.args == ["--training.steps", "20"]


def test_demanded_runs_go_first_then_the_longest_chain(tmp_path):
    pool = _pool(
        tmp_path,
        m=[
            Run("short", 1, ["--training.steps=2"]),
            Run("long", 4, ["--training.steps=40"]),
            Run("base", 1, ["--training.steps=3"]),
            Run("after_base", 4, ["--training.steps=60"], after="base"),
        ],
    )
    pool._critical_paths()
    keys = pool.modules["m"]
    # "base" is short, but the long run that waits for it makes its chain the longest
    assert pool._next().key == keys["base"]
    pool.entries[keys["short"]].demanded = 1.0
    assert pool._next().key == keys["short"]
