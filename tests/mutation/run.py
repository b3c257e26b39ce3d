"""Plants known bugs one at a time and checks that the test suite catches each of them.

    python tests/mutation/run.py                 # every mutant, table to stdout
    python tests/mutation/run.py --only tp_not_applied,dp_offset_off_by_one
    python tests/mutation/run.py --list          # the catalogue, nothing run
    python tests/mutation/run.py --markdown docs/mutation_check.md
    python tests/mutation/run.py --jobs 1        # one mutant at a time (default 2)

Each mutant is one exact text replacement in one product file. For each, the tracked tree is
copied to a temporary folder, the replacement is applied there (the working tree is never
touched), and only the tests that target the mutant run there (`pytest NODE ...`: one pytest
run, whose run pool, tests/run_pool.py, launches only the runs those tests declare, each
once however many of them read it). Two mutants run at a time (`--jobs`): each pytest run
starts with a few seconds of a single core importing torch and collecting, which the other
mutant's runs fill. A mutant is caught when at least one of
its target tests fails. The target tests pass on the unmutated tree: the suite runs them in
the same CI job, before this script. Exit status 1 if any mutant is missed, or if a mutant's
text is no longer found in its file (the catalogue must follow the code).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from catalogue import MUTANTS, Mutant  # tests/mutation/catalogue.py, next to this file

ROOT = Path(__file__).resolve().parents[2]


def tracked_files(root: Path) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout
    return [f for f in out.decode().split("\0") if f and (root / f).is_file()]


def mutated(mutant: Mutant, tree: Path) -> str:
    """The mutant's file in `tree` with the bug planted."""
    text = (tree / mutant.path).read_text()
    found = text.count(mutant.old)
    if found != 1:
        raise ValueError(
            f"mutant {mutant.name}: its text occurs {found} times in {mutant.path} (must be "
            "once): update the catalogue in tests/mutation/catalogue.py to follow the code"
        )
    return text.replace(mutant.old, mutant.new)


def failed_tests(junit: Path) -> list[str]:
    """Names of the tests that failed or errored, from pytest's JUnit XML report."""
    if not junit.is_file():
        return []
    names = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            names.append(case.get("name", "?"))
    return names


def run_mutant(mutant: Mutant, files: list[str], workdir: Path, timeout: float) -> dict:
    tree = workdir / mutant.name
    for f in files:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, tree / f)
    (tree / mutant.path).write_text(mutated(mutant, tree))
    junit = workdir / f"{mutant.name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
    cmd += [f"--junitxml={junit}", "--basetemp", str(workdir / f"{mutant.name}_tmp")]
    cmd += list(mutant.tests)
    # the tokenizer and token caches of this tree: the mutants change no data format
    env = {**os.environ, "MESHTRAIN_CACHE": str(ROOT / ".cache")}
    env.pop("CI", None)  # a skip is not a catch, and here it must not become a failure
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
        )
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, output = -1, f"timed out after {timeout:.0f} s\n{e.stdout or ''}"
    failed = failed_tests(junit)
    shutil.rmtree(tree, ignore_errors=True)
    return {
        "mutant": mutant,
        "failed": failed,
        # rc 5: no test collected, i.e. a target that does not exist (a catalogue error)
        "caught": rc not in (0, 5, -1) and bool(failed),
        "seconds": time.monotonic() - t0,
        "output": output[-3000:],
    }


def table(results: list[dict]) -> str:
    rows = ["| planted bug | file | target tests | failed tests | caught | s |", "|---" * 6 + "|"]
    for r in results:
        m = r["mutant"]
        targets = ", ".join(f"`{t.split('::', 1)[-1]}`" for t in m.tests)
        failed = ", ".join(f"`{f}`" for f in r["failed"]) or "none"
        rows.append(
            f"| {m.bug} | `{m.path}` | {targets} | {failed} | "
            f"{'yes' if r['caught'] else '**NO**'} | {r['seconds']:.0f} |"
        )
    return "\n".join(rows)


def _report(i: int, n: int, r: dict) -> dict:
    """Prints one mutant's outcome (in catalogue order, as each finishes) and returns it."""
    m = r["mutant"]
    print(f"[{i}/{n}] {m.name}: {m.bug}", flush=True)
    verdict = "caught by " + ", ".join(r["failed"]) if r["caught"] else "MISSED"
    print(f"    {verdict} ({r['seconds']:.0f} s)", flush=True)
    if not r["caught"]:
        print(r["output"], flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated mutant names")
    ap.add_argument("--list", action="store_true", help="print the catalogue and exit")
    ap.add_argument("--markdown", default="", help="also write the result table to this file")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant")
    ap.add_argument("--jobs", type=int, default=2, help="mutants at a time")
    args = ap.parse_args(argv)
    mutants = MUTANTS
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {m.name for m in MUTANTS}
        if unknown:
            ap.error(f"unknown mutants {sorted(unknown)}; see --list")
        mutants = [m for m in MUTANTS if m.name in names]
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.bug} ({m.path}) -> {', '.join(m.tests)}")
        return 0
    files = tracked_files(ROOT)
    for m in mutants:  # every mutant still applies, before anything runs
        mutated(m, ROOT)
    with tempfile.TemporaryDirectory(prefix="mutation_") as tmp:
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as ex:
            futures = [ex.submit(run_mutant, m, files, Path(tmp), args.timeout) for m in mutants]
            results = [_report(i, len(mutants), f.result()) for i, f in enumerate(futures, 1)]
    text = table(results)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    missed = [r["mutant"].name for r in results if not r["caught"]]
    print(f"mutation check: {len(results) - len(missed)} of {len(results)} planted bugs caught")
    if missed:
        print(f"missed: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
