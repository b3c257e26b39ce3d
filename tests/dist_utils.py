"""Helpers to launch real multi-process `train.py` runs on tiny configs and read their metrics.

Runs use gloo on CPU. Tests declare them as `Run`s and the suite-wide pool
(`tests/run_pool.py`) launches each distinct one once. `start_run` forks a run's ranks from
one warm process that has imported torch and the trainer already (`tests/fork_launcher.py`:
the environment torchrun gives its workers, torchrun's exit status);
MESHTRAIN_TEST_TORCHRUN=1 launches every run with torchrun itself instead, as `Run.command`
prints.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the test items pytest will run, after -k/-m deselection (tests/conftest.py stores them), so a
# module's fixture launches only the runs its selected tests need
SELECTED_ITEMS = "meshtrain_selected_items"
TINY_CONFIG = ROOT / "tests" / "tiny_model.toml"
# tiny_model.toml's shape as overrides of any config (debug_model, say): ~0.65M parameters
TINY_SHAPE = [
    "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
    "--model.n_kv_heads", "2",
]  # fmt: skip


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """This process as `rank` of a `fake` process group of `world` ranks (no communication,
    collectives of the real sizes), for unit tests that build real meshes and layouts."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class Run:
    """One `train.py` launch: its dump folder, ranks, arguments and (once done) its outcome."""

    name: str
    nproc: int
    args: list[str] = field(default_factory=list)
    folder: Path | None = None  # where it writes: the pool's choice (tests/run_pool.py)
    after: str | None = None  # start only once the run of this name has finished
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables
    config: str | Path = TINY_CONFIG  # --config: a preset name or a TOML file
    # (run name, path in its folder): copied into this run's folder before the launch
    copy_from: tuple[str, str] | None = None
    timeout: float = 900.0  # seconds, then the run is killed
    fresh: bool = False  # fresh interpreters rather than forks of the warm launcher
    returncode: int | None = None
    output: str = ""
    seconds: float = 0.0
    relaunched: str = ""  # why the run was launched a second time (a crashed rank), if it was

    def command(self) -> list[str]:
        cmd = [sys.executable]
        if self.nproc > 1:
            cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}"]
        return cmd + ["train.py", "--config", str(self.config), "--job.dump_folder",
                      str(self.folder), *self.args]  # fmt: skip

    def records(self, kind: str = "train") -> list[dict]:
        return read_records(self.folder, kind)

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records()}

    def param_counts(self) -> dict[str, int]:
        return read_param_counts(self.folder)

    def check(self) -> Run:
        assert self.returncode == 0, f"run {self.name} failed ({self.returncode}):\n{self.output}"
        return self


def read_records(folder: Path, kind: str = "train") -> list[dict]:
    """Records of one kind ("train", "validation", "memory") from `<folder>/metrics.jsonl`."""
    lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def read_param_counts(folder: Path) -> dict[str, int]:
    """The whole model's parameter counts the run wrote to `<folder>/layout.json`: total and
    non_embedding (for a mixture of experts also active and active_non_embedding)."""
    return json.loads((Path(folder) / "layout.json").read_text())["parameters"]


# the environment as the test run started: runs launched while a test patches os.environ do not
# inherit the patch
_SESSION_ENV = dict(os.environ)


def _env() -> dict[str, str]:
    return {**_SESSION_ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class _ForkedRun:
    """A run started by the fork launcher, with the part of `subprocess.Popen` used below."""

    _launcher: subprocess.Popen | None = None

    def __init__(self, run: Run, log_path: Path):
        launcher = self._start_launcher()
        self.rc_path = Path(str(log_path) + ".rc")
        self.rc_path.unlink(missing_ok=True)
        argv = ["--config", str(run.config), "--job.dump_folder", str(run.folder), *run.args]
        request = {"argv": argv, "nproc": run.nproc, "env": run.env, "log": str(log_path)}
        launcher.stdin.write(json.dumps(request) + "\n")
        launcher.stdin.flush()
        answer = launcher.stdout.readline()
        if not answer:
            raise RuntimeError(f"tests/fork_launcher.py died (exit status {launcher.wait()})")
        self.pid = int(answer)
        self.returncode: int | None = None
        self.crashed = ""  # "rank R died of signal S" when a rank crashed first

    @classmethod
    def _start_launcher(cls) -> subprocess.Popen:
        if cls._launcher is None or cls._launcher.poll() is not None:
            cls._launcher = subprocess.Popen(
                [sys.executable, "tests/fork_launcher.py"],
                cwd=ROOT,
                env=_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            atexit.register(cls._launcher.kill)
        return cls._launcher

    def poll(self) -> int | None:
        if self.returncode is None and self.rc_path.exists():
            fields = self.rc_path.read_text().split()
            self.returncode = int(fields[0])
            if fields[1:2] == ["crash"]:
                self.crashed = f"rank {fields[2]} died of signal {fields[3]}"
        return self.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.returncode = -signal.SIGKILL

    def wait(self) -> int | None:
        return self.returncode


def start_run(run: Run, log) -> subprocess.Popen | _ForkedRun:
    """`run` forked from the warm launcher, or in fresh interpreters (`python train.py`, or
    torchrun for several ranks) where it asks for them or MESHTRAIN_TEST_TORCHRUN is set."""
    if run.fresh or os.environ.get("MESHTRAIN_TEST_TORCHRUN", "") not in ("", "0"):
        return subprocess.Popen(
            run.command(),
            cwd=ROOT,
            env={**_env(), **run.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return _ForkedRun(run, Path(log.name))


def stop_run(proc: subprocess.Popen | _ForkedRun) -> None:
    """Kills a run started by `start_run` with every process of it (torchrun's workers too)."""
    if isinstance(proc, _ForkedRun):
        proc.kill()  # its supervisor's process group
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def rendezvous_port() -> int:
    """A free port for a run's MASTER_PORT, below the kernel's ephemeral range.

    A port the kernel hands out for `bind(0)` is free only until something else takes it:
    the rank that binds it for the TCPStore a moment later can find it taken by a connection
    of a concurrent run (gloo opens hundreds, from that same ephemeral range), and its peers
    then meet a stranger (seen once in CI: `TCPStore::ping` failed in a 4-rank run). Ports
    below the range are never given to connections; the search starts at a place set by this
    process's pid, so concurrent launchers try different ports first."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768  # Linux's default
    low = 10000
    span = max(first_ephemeral - low, 1000)
    for i in range(span):
        port = low + (os.getpid() * 7 + i) % span
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {low}..{low + span}")


def _spawned(rank: int, fn, world: int, port: int, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from training.distributed import cleanup

    try:
        fn(rank, world, *args)
    finally:
        cleanup()  # collects cycles first: see its docstring
    # The checks passed and the group is gone: leave without interpreter finalization, where
    # a gloo worker thread still freeing a tensor aborts the process (seen once in CI as
    # "terminate called without an active exception" after every assertion had passed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world: int, *args) -> None:
    """Runs `fn(rank, world, *args)` on `world` fresh processes joined in one gloo group;
    `fn` must be a module-level function. Raises if any rank fails."""
    import torch.multiprocessing as mp

    mp.start_processes(_spawned, args=(fn, world, rendezvous_port(), args), nprocs=world,
                       start_method="spawn")  # fmt: skip
