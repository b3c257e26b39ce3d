"""The suite-wide run pool: every `train.py` run of the suite declared as data, each distinct
run launched once, in the background, while the tests run.

A module declares its runs with a module-level function `pool_runs(selected)` that returns
`Run`s (tests/dist_utils.py) for the module's selected test items (after -k / -m, so
`pytest -k tp2` launches only what tp2 needs), and reads them through the `runs` fixture
(tests/conftest.py): {name: Run}, each with its folder, exit status and output. Before the
first test runs, the pool collects every module's declarations and de-duplicates them by key:
the ranks, the fully resolved configuration (the TOML preset plus the overrides, through the
real config loader; the output folder left out), the extra environment, and the keys of the
runs it starts from. Two modules that ask for the same run read one launch.

Every run shares one inductor cache (`{pool}/inductor`), as runs on one machine do: the
compiled kernels are keyed by their source, and the graphs by their content, so every rank of
every layout that compiles the same graph finds it (a graph holding a DTensor, under TP or EP,
is keyed by its rank and process groups too: `parallelisms.compile.key_compile_caches_to_rank`).
A run whose environment names TORCHINDUCTOR_CACHE_DIR keeps its own. An environment value may name `{pool}`, the pool's folder.

A run may start from another: `after` (a name of the same module: wait for it), `copy_from`
((name, path inside its folder): copied into this run's folder before the launch, "" the whole
folder) and `{run:NAME}` in an argument (that run's folder). Each of these also puts the other
run's key into this run's key.

Launches go through the one forking launcher (`dist_utils.start_run`), two at a time on 2
cores. Order: the runs a waiting test needs (and what they start from) first, else the
longest first by an estimate of their cost, so that no core idles at the end. A run whose
first failing rank died of a signal (a native crash) is relaunched once, its first log kept.
The pool prints what it de-duplicated at the end of the test run; `pool.log` in its folder has
one line per launch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from dist_utils import Run, start_run, stop_run

# runs at a time, and the ranks they may hold together (a run wider than that starts alone);
# MESHTRAIN_POOL_PARALLEL and MESHTRAIN_POOL_RANKS set others, to measure
PARALLEL = int(os.environ.get("MESHTRAIN_POOL_PARALLEL", 2))
RANKS = int(os.environ.get("MESHTRAIN_POOL_RANKS", 16))
PLACEHOLDER = re.compile(r"\{run:([^}]+)\}")
# what leaves the key: where a run writes, and words that change nothing it computes
UNKEYED = {("job", "dump_folder"), ("job", "config_file"), ("job", "description")}


def resolved_config(run: Run, args: list[str]) -> dict | str:
    """The configuration `args` give over `run.config`, as a dict, less UNKEYED: the loader's
    own normal form after its checks and inferences (`--a b`, `--a=b` and a value equal to the
    default are the same run; a dataset kind inferred from its path is the kind); the arguments
    themselves where the loader refuses them (a run that tests a refusal, or one whose input
    the check reads and a test writes later)."""
    from job_config.loader import parse_args
    from job_config.serialize import config_to_dict

    try:
        cfg = config_to_dict(parse_args(["--config", str(run.config), *args]))
    except (Exception, SystemExit):
        return f"{run.config} {' '.join(args)}"
    for section, key in UNKEYED:
        if not any(a.startswith(f"--{section}.{key}") for a in args):  # a folder of its own
            cfg[section].pop(key, None)
    return cfg


@dataclass
class Entry:
    """One distinct run: the first declaration of its key, and every (module, name) using it."""

    key: str
    run: Run  # launched as this, in the pool's folder, placeholders filled in
    deps: set[str]  # keys of the runs it starts from
    users: list[tuple[str, str]] = field(default_factory=list)
    cost: float = 1.0
    demanded: float = 0.0  # when a waiting test first asked for it (0: not yet)
    state: str = "pending"  # pending, active, done
    started: float = 0.0
    copy: tuple[Path, Path] | None = None  # copied before the launch: (source, destination)


def estimate(run: Run, cfg: dict | str) -> float:
    """Seconds on the 2-core machine, roughly: start-up, then steps x ranks x layers, more for
    compile (measured 4 ranks ~11 s, compiled ~45 s for 4 steps of 4 layers)."""
    if isinstance(cfg, str):
        return 5.0
    steps, layers = cfg["training"]["steps"], cfg["model"].get("n_layers") or 2
    seconds = 6 + 0.12 * steps * run.nproc * max(layers, 2) / 2
    return seconds + (35 if cfg["compile"]["enable"] else 0)


class Pool:
    def __init__(self, base: Path):
        self.base = base
        self.entries: dict[str, Entry] = {}
        self.modules: dict[str, dict[str, str]] = {}  # module -> {name: key}
        self.runs: dict[str, dict[str, Run]] = {}  # module -> {name: its declaration}
        self.declared = 0
        self.lock = threading.Condition()
        self.thread: threading.Thread | None = None
        self.closing = False
        self.paused = False  # no new launch while a timing-sensitive test runs (quiet())
        self.active: list[tuple[Entry, object, object]] = []

    # --- declaring ---------------------------------------------------------------------

    def declare(self, module: str, runs: list[Run]) -> None:
        """A module's runs, by name; keys resolved in dependency order."""
        by_name = {r.name: r for r in runs}
        assert len(by_name) == len(runs), f"{module}: a run name repeats"
        names: dict[str, str] = {}

        def key_of(name: str, seen=()) -> str:
            if name in names:
                return names[name]
            assert name in by_name, (
                f"{module}: a run starts from {name!r}, which it does not declare"
            )
            assert name not in seen, f"{module}: runs start from each other: {seen}"
            run = by_name[name]
            sources = self._sources(run)
            deps = {s: key_of(s, (*seen, name)) for s in sources}
            key_args = [PLACEHOLDER.sub(lambda m: "@" + deps[m.group(1)], a) for a in run.args]
            cfg = resolved_config(run, key_args)
            copy = None if run.copy_from is None else (deps[run.copy_from[0]], run.copy_from[1])
            blob = json.dumps([run.nproc, cfg, sorted(run.env.items()), copy, sorted(deps.values()),
                               run.fresh], sort_keys=True, default=str)  # fmt: skip
            key = hashlib.sha1(blob.encode()).hexdigest()[:12]
            names[name] = key
            self._add(key, run, deps, cfg, module)
            return key

        for name in by_name:
            key_of(name)
        self.modules[module], self.runs[module] = names, by_name
        self.declared += len(runs)

    @staticmethod
    def _sources(run: Run) -> list[str]:
        out = [run.after] if run.after else []
        out += [run.copy_from[0]] if run.copy_from else []
        out += [m.group(1) for a in run.args for m in PLACEHOLDER.finditer(a)]
        return list(dict.fromkeys(out))

    def _add(self, key: str, run: Run, deps: dict[str, str], cfg, module: str) -> None:
        entry = self.entries.get(key)
        if entry is None:
            folder = self.base / f"{run.name}-{key}"
            source = {name: self.entries[k].run.folder for name, k in deps.items()}
            args = [PLACEHOLDER.sub(lambda m: str(source[m.group(1)]), a) for a in run.args]
            launch = dataclasses.replace(run, folder=folder, args=args, after=None)
            entry = self.entries[key] = Entry(key, launch, set(deps.values()))
            entry.cost = estimate(run, cfg)
            if run.copy_from is not None:
                name, path = run.copy_from
                entry.copy = (source[name] / path, folder / path)
        entry.users.append((module, run.name))

    # --- launching -----------------------------------------------------------------------

    def start(self) -> None:
        """Starts the launching thread, unless it runs; it ends when no run is left to do."""
        with self.lock:
            if self.thread is None and self.entries:
                self.base.mkdir(parents=True, exist_ok=True)
                self._critical_paths()
                self.thread = threading.Thread(target=self._loop, name="run-pool", daemon=True)
                self.thread.start()

    def launch(self, owner: str, runs: list[Run]) -> dict[str, Run]:
        """Runs a test makes while it runs (arguments that name its own files), first in line;
        `owner` names them in the log (the test's node id)."""
        module = f"{owner}#{len(self.modules)}"
        with self.lock:
            self.declare(module, runs)
            self._critical_paths()
        return self.wait(module)

    def _critical_paths(self) -> None:
        """Each run's priority: its own cost plus the longest chain of runs that wait for it."""
        waiting: dict[str, list[Entry]] = {}
        for e in self.entries.values():
            for d in e.deps:
                waiting.setdefault(d, []).append(e)

        @functools.cache
        def chain(key: str) -> float:
            return self.entries[key].cost + max(
                (chain(w.key) for w in waiting.get(key, ())), default=0.0
            )

        self.priority = {k: chain(k) for k in self.entries}

    def _next(self) -> Entry | None:
        ready = [e for e in self.entries.values() if e.state == "pending"
                 and all(self.entries[d].state == "done" for d in e.deps)]  # fmt: skip
        if not ready:
            return None
        return min(ready, key=lambda e: (e.demanded or float("inf"), -self.priority[e.key]))

    def _loop(self) -> None:
        # waits on the lock's condition, not time.sleep: a test may patch time.sleep
        with self.lock:
            try:
                while not self.closing:
                    while not self.paused and len(self.active) < PARALLEL:
                        if (entry := self._next()) is None or not self._fits(entry):
                            break
                        self._guarded(self._launch, entry)
                    for item in list(self.active):
                        self._guarded(self._poll, *item)
                    self.lock.notify_all()
                    if all(e.state == "done" for e in self.entries.values()):
                        break
                    self.lock.wait(0.2)
            except BaseException:  # a bug of the pool: fail what is left, never hang a wait
                self._fail_all(traceback.format_exc())
                raise
            finally:
                self.thread = None  # under the lock: a later start() begins a new one
                self.lock.notify_all()

    def _fits(self, entry: Entry) -> bool:
        held = sum(e.run.nproc for e, _, _ in self.active)
        return not self.active or held + entry.run.nproc <= RANKS

    def _fail_all(self, why: str) -> None:
        for _entry, proc, log in self.active:
            stop_run(proc)
            log.close()
        self.active.clear()
        for entry in self.entries.values():
            if entry.state != "done":
                entry.state, entry.run.returncode = "done", -1
                entry.run.output = f"run pool: stopped by an error of its own:\n{why}"

    def _guarded(self, step, entry: Entry, *rest) -> None:
        """`step(entry, ...)`; an error of the pool itself fails that run, not the test run."""
        try:
            step(entry, *rest)
        except Exception as e:
            if rest and (entry, *rest) in self.active:
                self.active.remove((entry, *rest))
                stop_run(rest[0])
                rest[1].close()
            entry.state, entry.run.returncode = "done", -1
            entry.run.output = f"run pool: {entry.run.name}: {type(e).__name__}: {e}"

    def _launch(self, entry: Entry) -> None:
        run = entry.run
        failed = [d for d in entry.deps if self.entries[d].run.returncode != 0]
        if failed:
            entry.state, run.returncode = "done", -1
            names = ", ".join(self.entries[d].run.name for d in failed)
            run.output = (
                f"run pool: {run.name} not launched: the run(s) it starts from failed: {names}"
            )
            return
        if entry.copy is not None:
            src, dst = entry.copy
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, dst, dirs_exist_ok=True)
        log = open(run.folder.with_suffix(".log"), "w+")  # closed when the run ends
        env = {"TORCHINDUCTOR_CACHE_DIR": "{pool}/inductor", **run.env}
        env = {k: v.replace("{pool}", str(self.base)) for k, v in env.items()}
        proc = start_run(dataclasses.replace(run, env=env), log)
        entry.state, entry.started = "active", time.monotonic()
        self.active.append((entry, proc, log))

    def _poll(self, entry: Entry, proc, log) -> None:
        run = entry.run
        if proc.poll() is None and time.monotonic() - entry.started <= run.timeout:
            return
        overdue = proc.poll() is None
        if overdue:
            stop_run(proc)
        log.seek(0)
        output = log.read()[-20000:]
        log.close()
        self.active.remove((entry, proc, log))
        if getattr(proc, "crashed", "") and not run.relaunched:
            aside = run.folder.with_name(run.folder.name + ".crashed")
            os.replace(run.folder.with_suffix(".log"), f"{aside}.log")
            if run.folder.exists():
                os.replace(run.folder, aside)
            run.relaunched = f"{proc.crashed}: relaunched once (first attempt: {aside})"
            entry.state = "pending"
            return
        run.returncode, run.seconds = proc.returncode, time.monotonic() - entry.started
        timed_out = f"run pool: {run.name} killed after {run.timeout:.0f} s\n" if overdue else ""
        note = f"run pool: {run.name}: {run.relaunched}\n" if run.relaunched else ""
        run.output = timed_out + note + output
        entry.state = "done"
        with open(self.base / "pool.log", "a") as f:
            users = " ".join(f"{m}::{n}" for m, n in entry.users)
            f.write(
                f"{run.name} rc={run.returncode} {run.seconds:.1f}s ranks={run.nproc} {users}\n"
            )

    # --- reading -------------------------------------------------------------------------

    def wait(self, module: str) -> dict[str, Run]:
        """The module's runs once all are done, as the module named them (its own arguments,
        the shared launch's folder and outcome)."""
        names = self.modules.get(module, {})
        self.start()
        with self.lock:
            now = time.monotonic()
            todo = list(names.values())
            while todo:  # the module's runs and what they start from go first
                entry = self.entries[todo.pop()]
                if not entry.demanded:
                    entry.demanded = now
                todo += list(entry.deps)
            while not all(self.entries[k].state == "done" for k in names.values()):
                if self.thread is None:  # ended with runs left: start it again
                    self.lock.release()
                    try:
                        self.start()
                    finally:
                        self.lock.acquire()
                self.lock.wait(1.0)
        return {name: self._view(module, name, self.entries[key]) for name, key in names.items()}

    def _view(self, module: str, name: str, entry: Entry) -> Run:
        """The module's declaration of `name`, with the shared launch's folder and outcome."""
        base, done = self.runs[module][name], entry.run
        args = [PLACEHOLDER.sub(lambda m: str(self._folder(module, m.group(1))), a)
                for a in base.args]  # fmt: skip
        return dataclasses.replace(base, folder=done.folder, args=args, returncode=done.returncode,
                                   output=done.output, seconds=done.seconds,
                                   relaunched=done.relaunched)  # fmt: skip

    def _folder(self, module: str, name: str) -> Path:
        return self.entries[self.modules[module][name]].run.folder

    @contextlib.contextmanager
    def quiet(self):
        """No run of the pool alongside: new launches wait and the running ones finish first,
        for tests whose own deadlines assume an otherwise idle machine."""
        with self.lock:
            self.paused = True
            self.lock.wait_for(lambda: not self.active or self.thread is None)
        try:
            yield
        finally:
            with self.lock:
                self.paused = False
                self.lock.notify_all()

    def close(self) -> None:
        """Ends the test run's launches: what is still running is killed."""
        with self.lock:
            self.closing = True
            for _entry, proc, log in self.active:
                stop_run(proc)
                log.close()
            self.active.clear()

    def summary(self) -> str:
        launched = [e for e in self.entries.values() if e.run.returncode is not None]
        seconds = sum(e.run.seconds for e in launched)
        shared = sum(len(e.users) > 1 for e in self.entries.values())
        return (f"run pool: {self.declared} runs declared by {len(self.modules)} modules, "
                f"{len(self.entries)} distinct ({self.declared - len(self.entries)} de-duplicated, "
                f"{shared} runs read by several declarations); {len(launched)} launched, "
                f"{seconds:.0f} run-seconds; log: {self.base / 'pool.log'}")  # fmt: skip
