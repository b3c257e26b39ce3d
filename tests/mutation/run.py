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
once however many of them read it). That pytest runs in a process forked from a server that
has already imported torch, transformers and the other third-party modules the tests use
(never a module of this tree, which each mutant imports from its own copy): a fresh `python -m
pytest` spends about 5 of its seconds importing them, for each of the ~90 mutants. Two mutants
run at a time (`--jobs`). A mutant is caught when at least one of
its target tests fails. The target tests pass on the unmutated tree: the suite runs them in
the same CI job, before this script. Exit status 1 if any mutant is missed, or if a mutant's
text is no longer found in its file (the catalogue must follow the code).
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from catalogue import MUTANTS, Mutant  # tests/mutation/catalogue.py, next to this file

ROOT = Path(__file__).resolve().parents[2]
# imported once by the fork server each mutant's pytest starts from: third-party modules only
# (a module of this tree imported there would shadow the mutant's copy of it)
PRELOAD = [
    "torch", "torch._dynamo", "torch._inductor.config", "torch.distributed.fsdp",
    "torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.pipelining",
    "numpy", "sympy", "pyarrow", "tokenizers", "tiktoken", "sentencepiece", "transformers",
    "transformers.modeling_utils", "pytest",
]  # fmt: skip


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


def _pytest_in(tree: str, args: list[str], env: dict, log: str) -> None:
    """In a process forked from the preloaded server: `pytest ARGS` as `python -m pytest`
    would run it in `tree` (its folder first on the path, its environment), output to `log`;
    exits with pytest's status after the exit handlers (the run pool's launcher is stopped by
    one)."""
    os.setsid()  # its own process group, which a timeout kills whole
    os.chdir(tree)
    sys.path.insert(0, tree)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import pytest

    rc = int(pytest.main(args))
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _forked_pytest(tree: Path, args: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """`pytest ARGS` in `tree` from the fork server: (exit status, output); -1 on timeout."""
    log = str(tree) + ".log"
    proc = _SERVER.Process(target=_pytest_in, args=(str(tree), args, env, log))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.join()
        rc = -1
    else:
        rc = proc.exitcode
    output = Path(log).read_text(errors="replace") if os.path.exists(log) else ""
    if rc == -1:
        output = f"timed out after {timeout:.0f} s\n{output}"
    return rc, output


_SERVER = multiprocessing.get_context("forkserver")


def run_mutant(mutant: Mutant, files: list[str], workdir: Path, timeout: float) -> dict:
    tree = workdir / mutant.name
    for f in files:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, tree / f)
    (tree / mutant.path).write_text(mutated(mutant, tree))
    junit = workdir / f"{mutant.name}.xml"
    args = ["-q", "-p", "no:cacheprovider", "-x"]
    args += [f"--junitxml={junit}", "--basetemp", str(workdir / f"{mutant.name}_tmp")]
    args += list(mutant.tests)
    # the tokenizer and token caches of this tree: the mutants change no data format
    env = {**os.environ, "MESHTRAIN_CACHE": str(ROOT / ".cache")}
    env.pop("CI", None)  # a skip is not a catch, and here it must not become a failure
    t0 = time.monotonic()
    rc, output = _forked_pytest(tree, args, env, timeout)
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
    _SERVER.set_forkserver_preload(PRELOAD)
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
