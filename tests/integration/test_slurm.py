"""scripts/multinode_trainer.slurm on a real one-node SLURM cluster started by this test.

Installs Debian's slurmd/slurmctld/slurm-client/munge when missing (root only; skipped with
the reason when apt cannot reach its mirrors), writes a minimal slurm.conf in a temporary
folder, starts munged (as user munge, unless one already answers), slurmctld and slurmd,
then `sbatch`es the script: a tiny 2-worker CPU run that must write its metrics and
checkpoints, and a run warned of its time limit (USR1 to the batch shell, as
`--signal=B:USR1@120` does) that must checkpoint, requeue itself and finish from the
checkpoint; and scripts/pretokenize.py as a 2-task datatrove job array. Every daemon this
test started is stopped by its pid file at the end.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import TINY_SHAPE

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "multinode_trainer.slurm"
PACKAGES = ["slurmd", "slurmctld", "slurm-client", "munge"]
TINY = " ".join(TINY_SHAPE) + (
    " --training.seq_len 32 --training.local_batch_size 4 --training.device cpu "
    "--validation.enable false --metrics.enable_tensorboard false --lr_scheduler.warmup_steps 2"
)


def _run(cmd, timeout=60, check=True, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode:
        raise RuntimeError(f"{cmd}: exit {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out


def _ensure_packages() -> None:
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("SLURM is not installed and this is not a root Debian machine (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    update = _run(["apt-get", "update"], timeout=600, check=False, env=env)
    if update.returncode or "Err:" in update.stdout + update.stderr:
        pytest.skip(f"apt-get update cannot reach the package mirrors:\n{update.stderr[-500:]}")
    _run(["apt-get", "install", "-y", "-q", *PACKAGES], timeout=900, env=env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _mem_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 4096


def _write_conf(tmp: Path, host: str) -> Path:
    for d in ("spool", "state", "log"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    conf = tmp / "slurm.conf"
    conf.write_text(
        f"""ClusterName=meshtraintest
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SlurmUser=root
SlurmdSpoolDir={tmp}/spool
StateSaveLocation={tmp}/state
SlurmctldLogFile={tmp}/log/ctld.log
SlurmdLogFile={tmp}/log/d.log
SlurmctldPidFile={tmp}/ctld.pid
SlurmdPidFile={tmp}/d.pid
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=600
# A requeued job waits for the old job's credential to expire (default 120 s).
AuthInfo=cred_expire=10
NodeName={host} CPUs={os.cpu_count()} RealMemory={int(_mem_mib() * 0.8)} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
    )
    return conf


def _munge_works() -> bool:
    enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    if enc.returncode:
        return False
    dec = subprocess.run(["unmunge"], input=enc.stdout, capture_output=True, timeout=10)
    return dec.returncode == 0


def _start_munge() -> Path | None:
    """Starts munged as user munge unless one already answers; returns our pid file."""
    if shutil.which("munge") and _munge_works():
        return None
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        _run(["mungekey", "-c", "-k", str(key)])
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    for d in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
        Path(d).mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    pid = Path("/run/munge/meshtrain-test-munged.pid")  # munge cannot enter root's tmp
    _run(["runuser", "-u", "munge", "--", "munged", f"--pid-file={pid}", "--force"])
    for _ in range(50):
        if _munge_works():
            return pid
        time.sleep(0.2)
    raise RuntimeError("munged did not start")


def _stop(pid_file: Path) -> None:
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    # slurmctld saves its state before it exits, which can take seconds on a busy machine; a
    # daemon may also exit between the last look and the SIGKILL, which is not an error.
    for _ in range(150):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _ensure_packages()
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld/slurmd/munged needs root")
    tmp = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname().split(".")[0]
    conf = _write_conf(tmp, host)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started: list[Path] = []
    try:
        munge_pid = _start_munge()
        if munge_pid is not None:
            started.append(munge_pid)
        _run(["slurmctld", "-f", str(conf), "-c"], env=env)
        started.append(tmp / "ctld.pid")
        _run(["slurmd", "-f", str(conf)], env=env)
        started.append(tmp / "d.pid")
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            state = _run(["sinfo", "-h", "-o", "%T"], env=env, check=False).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        logs = "".join(p.read_text()[-2000:] for p in (tmp / "log").glob("*.log"))
        assert state == "idle", f"node state {state!r}\n{logs}"
        yield env, tmp
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True, timeout=30)
        for pid_file in reversed(started):
            _stop(pid_file)


def _sbatch(env: dict, tmp: Path, name: str, extra: str) -> tuple[str, Path]:
    dump = tmp / name
    job_env = {
        **env,
        "CONFIG_FILE": "debug_model",
        "EXTRA_ARGS": f"{TINY} {extra}",
        "DUMP_FOLDER": str(dump),
        "NPROC_PER_NODE": "2",
        "RDZV_PORT": str(_free_port()),
        "PYTHON": sys.executable,
    }
    out = _run(
        ["sbatch", "--parsable", "--job-name", name, "--nodes=1", "--ntasks-per-node=1",
         f"--output={tmp}/{name}-%j.out", "--time=15", str(SCRIPT)],
        env=job_env, cwd=ROOT,
    )  # fmt: skip
    return out.stdout.strip().split(";")[0], dump


def _job(env: dict, job_id: str) -> dict[str, str]:
    text = _run(["scontrol", "show", "job", job_id], env=env, check=False).stdout
    return dict(f.split("=", 1) for f in text.split() if "=" in f)


def _wait_done(env: dict, job_id: str, timeout: float = 300) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    info = {}
    while time.monotonic() < deadline:
        info = _job(env, job_id)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return info
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not finish: {info}")


def _records(dump: Path) -> list[dict]:
    path = dump / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return [r for r in records if r["kind"] == "train"]


def _node_out(dump: Path) -> str:
    return "".join(p.read_text()[-4000:] for p in dump.glob("slurm/*.out"))


def _out(tmp: Path, name: str) -> str:
    return "".join(p.read_text() for p in sorted(tmp.glob(f"{name}-*.out")))


@pytest.fixture(scope="module")
def jobs(cluster):
    """Both jobs run at once (the node has a CPU for each); the second one is warned of its
    time limit once it has logged 3 steps."""
    env, tmp = cluster
    basic = _sbatch(
        env,
        tmp,
        "basic",
        "--training.steps 6 --checkpoint.enable true --checkpoint.interval 3 --metrics.log_freq 1",
    )
    preempt = _sbatch(
        env,
        tmp,
        "preempt",
        # only the stop and the last step save a checkpoint
        "--training.steps 60 --metrics.log_freq 1 --checkpoint.enable true "
        "--checkpoint.interval 1000",
    )
    job_id, dump = preempt
    deadline = time.monotonic() + 240
    while len(_records(dump)) < 3:
        assert time.monotonic() < deadline, _out(tmp, "preempt")[-4000:]
        state = _job(env, job_id).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (
            f"job {state}:\n" + _out(tmp, "preempt")[-4000:] + _node_out(dump)
        )
        time.sleep(0.5)
    # What `#SBATCH --signal=B:USR1@120` does before the time limit: USR1 to the batch shell.
    _run(["scancel", "--batch", "--signal=USR1", job_id], env=env)
    return {"basic": basic, "preempt": preempt}


def test_sbatch_two_worker_run_writes_metrics_and_checkpoints(cluster, jobs):
    env, tmp = cluster
    job_id, dump = jobs["basic"]
    info = _wait_done(env, job_id)
    detail = _out(tmp, "basic") + _node_out(dump)
    assert info["JobState"] == "COMPLETED", detail[-4000:]
    assert [r["step"] for r in _records(dump)] == list(range(1, 7))
    assert sorted(p.name for p in (dump / "checkpoint").glob("step-*")) == ["step-3", "step-6"]
    assert (dump / "logs" / "rank_1.log").exists()
    assert "x 2 workers, rendezvous" in detail


def test_time_limit_warning_checkpoints_requeues_and_resumes(cluster, jobs):
    env, tmp = cluster
    job_id, dump = jobs["preempt"]
    info = _wait_done(env, job_id, timeout=400)
    out = _out(tmp, "preempt")
    assert info["JobState"] == "COMPLETED", out[-4000:] + _node_out(dump)
    assert int(info["Restarts"]) == 1, info
    assert "stopped by SIGUSR1: requeueing job" in out
    log0 = (dump / "logs" / "rank_0.log").read_text()
    stopped = int(log0.split("stopping at step ")[1].split()[0])
    assert f"checkpoint/step-{stopped}" in log0.split("checkpoint: loaded ")[1].split("\n")[0]
    steps = [r["step"] for r in _records(dump)]
    assert steps[-1] == 60 and steps.index(stopped + 1) == stopped  # resumed after the stop
    saved = {p.name for p in (dump / "checkpoint").glob("step-*")}
    assert saved == {f"step-{stopped}", "step-60"}


# ------------------------------------------------------------------ skips under CI (conftest)
# The skips above must not turn a CI run green: tests/conftest.py makes every skip a failure
# when CI is set. These inner pytest runs (pytester) prove it with the real conftest.

INNER = """
import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip("no widget on this machine")

@pytest.mark.skipif(True, reason="marked off here")
def test_marked():
    pass
"""
INNER_IMPORT = (
    "import pytest\npytest.importorskip('no_such_module_xyz')\n\ndef test_x():\n    pass\n"
)


def _inner(pytester, monkeypatch, ci: str | None, *files: str, extra_conftest: str = ""):
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text() + extra_conftest)
    pytester.makepyfile(test_inner=INNER, test_inner_import=INNER_IMPORT)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    return pytester.runpytest_subprocess("-ra", "-p", "no:cacheprovider", *files)


@pytest.mark.parametrize("ci", [None, "", "0", "false"])
def test_without_ci_a_skip_passes_and_the_summary_says_why(pytester, monkeypatch, ci):
    result = _inner(pytester, monkeypatch, ci, "test_inner.py", "test_inner_import.py")
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines(
        [
            "*short test summary info*",
            "SKIPPED [[]1[]] test_inner_import.py:2: could not import*no_such_module_xyz*",
            "SKIPPED [[]1[]] test_inner.py:*: no widget on this machine",
            "SKIPPED [[]1[]] test_inner.py:*: marked off here",
        ]
    )


@pytest.mark.parametrize("ci", ["true", "1"])
def test_under_ci_every_skip_fails_naming_the_test_and_reason(pytester, monkeypatch, ci):
    result = _inner(pytester, monkeypatch, ci, "test_inner.py")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    # pytest.skip in the test fails it; a skipif mark fails its setup (an error)
    result.assert_outcomes(passed=1, failed=1, errors=1, skipped=0)
    result.stdout.fnmatch_lines(
        [
            "*short test summary info*",
            f"ERROR test_inner.py::test_marked - Failed: test_inner.py::test_marked skipped "
            f"under CI='{ci}': marked off here (a skip fails CI*",
            f"FAILED test_inner.py::test_skips - Failed: test_inner.py::test_skips skipped "
            f"under CI='{ci}': no widget on this machine (a skip fails CI*",
        ]
    )
    # a module-level importorskip fails the collection (pytest then runs nothing: exit 2)
    out = _inner(pytester, monkeypatch, ci, "test_inner_import.py")
    assert out.ret == pytest.ExitCode.INTERRUPTED, out.stdout.str()
    out.stdout.fnmatch_lines(
        [
            f"ERROR test_inner_import.py - Failed: test_inner_import.py skipped under "
            f"CI='{ci}': could not import 'no_such_module_xyz'*"
        ]
    )


def test_under_ci_only_listed_skips_pass_and_never_the_protected_files(pytester, monkeypatch):
    allow = '\nCI_ALLOWED_SKIPS["test_inner.py::test_skips"] = "no widget in CI"\n'
    result = _inner(pytester, monkeypatch, "true", "test_inner.py", extra_conftest=allow)
    result.assert_outcomes(passed=1, skipped=1, errors=1)
    # the SLURM test and the parity layouts cannot be listed: pytest refuses to start
    for path in (
        "tests/integration/test_slurm.py",
        "tests/integration/test_pipeline_parity.py::test_losses",
    ):
        banned = f'\nCI_ALLOWED_SKIPS["{path}"] = "no"\n'
        result = _inner(pytester, monkeypatch, "true", "test_inner.py", extra_conftest=banned)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
        assert "must never skip in CI" in result.stderr.str()


def test_pretokenize_runs_as_a_two_task_job_array(cluster, tmp_path):
    """scripts/pretokenize.py --executor slurm submits a 2-task job array (datatrove's SLURM
    executor) whose shards are byte for byte those of the local executor's 2 tasks."""
    from data.sample_corpus import default_cache_dir, ensure_sample_tokenizer

    env, _ = cluster
    folder = tmp_path / "corpus"
    folder.mkdir()
    for f in range(4):
        docs = [{"text": f"file {f} doc {i} " + "words " * (i % 7)} for i in range(30)]
        (folder / f"f{f}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = ["--format", "jsonl", "--input", str(folder), "--tasks", "2",
              "--tokenizer", ensure_sample_tokenizer(default_cache_dir())]  # fmt: skip
    script = [sys.executable, str(ROOT / "scripts" / "pretokenize.py"), *common]
    _run([*script, "--output", str(tmp_path / "local"), "--workers", "2"], timeout=300)
    array = tmp_path / "array"
    _run([*script, "--output", str(array), "--executor", "slurm", "--partition", "debug",
          "--time", "10", "--mem-per-cpu-gb", "1", "--srun-arg", "mpi=none"],
         env=env, cwd=ROOT, timeout=120)  # fmt: skip
    assert "#SBATCH --array=0-1" in (tmp_path / "array.logs" / "launch_script.slurm").read_text()
    deadline = time.monotonic() + 300
    while len(list(array.glob("*.meta.json"))) < 2:
        logs = "".join(p.read_text()[-2000:] for p in (tmp_path / "array.logs").rglob("*.out"))
        assert time.monotonic() < deadline and "Traceback" not in logs, logs
        time.sleep(1)
    for name in [f"0000{t}{s}" for t in range(2) for s in (".bin", ".idx")]:
        assert (array / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name
