"""Fault tolerance on 2 CPU ranks: a rank that dies is restarted by torchrun and the run
resumes from its latest checkpoint with the uninterrupted run's losses; a rank that hangs
turns into an error naming the rank and the step after comm.train_timeout_seconds; a rank
that fails (no restart) shows its own error on the console.

The four launches run at once (one fixture), since most of their time is start-up.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# a 5-second collective timeout and restarts: no pool run alongside (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("quiet_pool")
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "tiny_model.toml"
COMMON = ["--training.steps", "6", "--training.local_batch_size", "4"]


def _start(dump: Path, args: list[str], restarts: int = 0, env: dict | None = None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [f"--max-restarts={restarts}", "train.py", "--config", str(TINY)]
    cmd += ["--job.dump_folder", str(dump), *COMMON, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    out = open(dump.with_suffix(".out"), "w")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    return proc, out


def _losses(dump: Path) -> dict[int, float]:
    """The last logged loss of every step (a resumed run logs the replayed steps again)."""
    out = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "train":
            out[r["step"]] = r["loss"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ft")
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    specs = {
        "reference": (ckpt, 0, None),
        "failing": (ckpt + ["--debug.fail_at_step", "4"], 1, None),
        "hang": (["--comm.train_timeout_seconds", "5", "--debug.hang_at_step", "3"], 0, None),
        "failed": (["--debug.fail_at_step", "1"], 0, None),  # no restart: the job fails
    }
    started = {}
    for name, (args, restarts, env) in specs.items():
        dump = base / name
        started[name] = (dump, *_start(dump, args, restarts, env), time.monotonic())
    done = {}
    for name, (dump, proc, out, t0) in started.items():
        try:
            rc = proc.wait(timeout=400)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
        out.close()
        done[name] = (dump, rc, dump.with_suffix(".out").read_text(), time.monotonic() - t0)
    return done


def test_dead_rank_is_restarted_and_resumes_with_identical_losses(runs):
    ref_dump, ref_rc, ref_out, _ = runs["reference"]
    dump, rc, out, _ = runs["failing"]
    assert ref_rc == 0, ref_out[-3000:]
    assert rc == 0, out[-3000:]
    log1 = (dump / "logs" / "rank_1.log").read_text()
    assert "rank 1 failed at step 4: RuntimeError: debug.fail_at_step = 4: injected" in log1
    log0 = (dump / "logs" / "rank_0.log").read_text()
    # the restart loads step 2's checkpoint (the loaded line itself, not any later line)
    loads = [line for line in log0.splitlines() if "checkpoint: loaded " in line]
    assert len(loads) == 1, log0[-3000:]
    assert f"loaded {dump / 'checkpoint' / 'step-2'} (" in loads[0] and " step 2:" in loads[0]
    reference = _losses(ref_dump)
    assert sorted(reference) == list(range(1, 7))
    assert _losses(dump) == reference  # bit-identical (deterministic CPU runs)
    assert sorted(p.name for p in (dump / "checkpoint").glob("step-*")) == [
        "step-2",
        "step-4",
        "step-6",
    ]


def test_hung_rank_becomes_an_error_naming_rank_and_step(runs):
    dump, rc, out, seconds = runs["hang"]
    assert rc != 0
    log0 = (dump / "logs" / "rank_0.log").read_text()
    assert "rank 0 failed at step 3" in log0, log0[-3000:]
    assert "comm.train_timeout_seconds = 5" in log0
    assert seconds < 200


def test_failing_rank_reports_its_own_error_on_the_console(runs):
    """Only the last rank fails: the console (torchrun's output, where rank 0 logs) carries that
    rank's own error, not only rank 0's "Connection closed by peer", and torchrun's summary
    names it (the rank's error file)."""
    dump, rc, out, _ = runs["failed"]
    assert rc != 0
    own = "[rank1] rank 1 failed at step 1: RuntimeError: debug.fail_at_step = 1: injected"
    assert own in out, out[-3000:]
    summary = out[out.index("train.py FAILED") :]  # from the rank's error file
    assert "StepError: rank 1 failed at step 1: RuntimeError: debug.fail_at_step" in summary
