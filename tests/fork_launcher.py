"""A warm launcher for the tests' `train.py` runs: imports torch and the trainer once, then
forks every rank of every run from itself, so no run pays the imports again.

Most of a tiny test run's wall time is process start-up, and most of that is importing torch
and the project (about 3 CPU-seconds a process, 4 processes for a 2-rank torchrun launch).
`tests/dist_utils.start_run` starts this script once per test process and writes one JSON
request per line to its stdin: {"argv", "nproc", "env", "log"}. For each it forks a
supervisor (answering its pid on stdout), which forks the ranks with the environment torchrun
gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...), each running
`training.launch.run(argv)` (train.py's main) with stdout and stderr in the run's log, and writes the run's exit status to
`<log>.rc` when all are done: torchrun's status (0, or 1 if any rank failed, the other ranks
then stopped as torchrun stops them) or, for one process, `python train.py`'s own; followed by
"crash RANK SIGNAL" when the first rank to fail was killed by a signal (a native crash, not a
Python error: the run pool, tests/run_pool.py, relaunches such a run once).

What a fork keeps: only imported modules; the parent runs no torch operation and starts no
thread (checked), so each rank initialises its process group, thread pools and RNGs itself
as a fresh process would; the imported objects are frozen out of the garbage collector
(`gc.freeze`), which a rank's collections then skip. Runs that need torchrun's own features
(restarts, its signal handling) are launched by their tests with torchrun itself.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import sys
import threading
import time

# What every run imports: loaded here once, shared by every fork.
import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (deterministic mode and compile import it)
import torch._inductor.config  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
from dist_utils import rendezvous_port

import training.loop  # noqa: F401
import training.trainer  # noqa: F401
from checkpoint import manager  # noqa: F401
from training.launch import run

GRACE_S = 30  # after one rank fails, how long the others get before they are killed


def _rank(argv: list[str], env: dict[str, str], log: int) -> None:
    """In a forked child: become one rank of the run and exit with train.py's status."""
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    faulthandler.enable()  # a crash in C++ code still leaves the Python stack in the log
    sys.argv = ["train.py", *argv]
    code = 1
    try:
        code = run(argv)  # train.py's main less --help
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _supervise(request: dict) -> None:
    """In a forked child: fork the run's ranks, wait for them, write `<log>.rc`."""
    os.setsid()  # the test process kills the whole run with its process group on a timeout
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    nproc, log_path = request["nproc"], request["log"]
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    base = dict(request["env"])
    if nproc > 1:  # what torchrun --standalone gives its workers
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous_port()),
                    WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                    ROLE_WORLD_SIZE=str(nproc), TORCHELASTIC_RUN_ID="fork_launcher")  # fmt: skip
    pids = {}
    for rank in range(nproc):
        env = dict(base)
        if nproc > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
        pid = os.fork()
        if pid == 0:
            _rank(request["argv"], env, log)
        pids[pid] = rank
    codes, failed_at, crash = {}, None, ""
    while len(codes) < nproc:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for other in set(pids) - set(codes):
                    os.kill(other, signal.SIGKILL)
            time.sleep(0.05)
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0:  # as torchrun reports a failed worker
            how = f"signal {-codes[pid]}" if codes[pid] < 0 else f"exit code {codes[pid]}"
            os.write(log, f"fork_launcher: rank {pids[pid]} ended with {how}\n".encode())
        if codes[pid] != 0 and failed_at is None:
            failed_at = time.monotonic()
            if codes[pid] < 0:  # the first rank to fail was killed by a signal: a crash
                crash = f" crash {pids[pid]} {-codes[pid]}"
            for other in set(pids) - set(codes):  # torchrun stops the others too
                os.kill(other, signal.SIGTERM)
    if nproc == 1:
        rc = next(iter(codes.values()))
    else:
        rc = 0 if all(c == 0 for c in codes.values()) else 1
    tmp = log_path + ".rc.tmp"
    with open(tmp, "w") as f:
        f.write(f"{rc}{crash}")
    os.replace(tmp, log_path + ".rc")
    os._exit(0)


def main() -> None:
    if threading.active_count() != 1:
        raise SystemExit(f"fork_launcher: {threading.active_count()} threads after imports")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped automatically
    # The imports' objects (~280k with torch, measured) out of the collector's reach: a rank's
    # full collections (its cleanup's two, the automatic ones) no longer walk them, 0.1 CPU-s each.
    gc.freeze()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _supervise(request)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
