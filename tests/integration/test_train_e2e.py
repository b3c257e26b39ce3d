"""End-to-end runs of train.py: 2 CPU ranks, determinism, NaN guard, SIGTERM (under torchrun
itself: the signal goes to one of its workers), corpora and mixtures."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from dist_utils import TINY_SHAPE, Run, read_param_counts

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--config",
    "debug_model",
    *TINY_SHAPE,
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "4",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
]


def run(name: str, *args: str, nproc: int = 1, **fields) -> Run:
    """A run of the tiny debug model (through the run pool, tests/run_pool.py)."""
    return Run(name, nproc, [*TINY[2:], *args], config=TINY[1], **fields)


DETERMINISTIC = ("--training.steps", "4", "--debug.deterministic", "true",
                 "--validation.enable", "false")  # fmt: skip


RUNS = {  # test -> the runs it reads
    "test_two_rank_run_learns_and_writes_every_output": [
        run("two_ranks", "--training.steps", "20", "--optimizer.lr", "3e-3",
            "--validation.freq", "10", "--validation.steps", "2", nproc=2)],
    # two fresh interpreters (not forks of one warm process, which share the hash seed and
    # whatever was drawn at import), the second a launch of its own after the first
    "test_deterministic_runs_are_bit_identical": [
        run("a", *DETERMINISTIC, fresh=True), run("b", *DETERMINISTIC, after="a", fresh=True)],
    # A huge LR makes the weights ~1e30 after step 1, so step 2's forward overflows to NaN.
    "test_non_finite_loss_stops_the_run_naming_the_step": [
        run("nan", "--training.steps", "10", "--optimizer.lr", "1e30", "--training.max_norm", "0",
            "--validation.enable", "false")],
}  # fmt: skip


def pool_runs(selected) -> list[Run]:
    return [r for name in {item.originalname for item in selected} for r in RUNS.get(name, [])]


def torchrun(dump: Path, *args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "train.py", *TINY, "--job.dump_folder", str(dump), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


def records(dump: Path, kind: str = "train") -> list[dict]:
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_two_rank_run_learns_and_writes_every_output(runs):
    dump = runs["two_ranks"].check().folder
    train = records(dump)
    assert [r["step"] for r in train] == list(range(1, 21))
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "tokens_per_sec",
        "tflops",
        "mfu",
        "memory_gib",
        "step_time_s",
        "data_time_s",
    ):
        assert all(isinstance(r[key], (int, float)) for r in train), key
    # the LR each step used: warmup 2 gives steps 1 and 2 a third and two thirds of the peak;
    # the cosine decay reaches min_lr_factor 0.1 at the last step
    assert [r["lr"] for r in train[:2]] == pytest.approx([1e-3, 2e-3])
    assert train[-1]["lr"] == pytest.approx(3e-4)
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-3:]) / 3
    assert 7.5 < first < 10.0  # about ln(4096) = 8.3 at init
    # shuffled windows (training.shuffle, the default) are more varied than consecutive ones:
    # 20 steps take ~0.9 off the loss (~1.5 in corpus order)
    assert last < first - 0.6, (first, last)
    val = records(dump, "validation")
    assert [r["step"] for r in val] == [10, 20]
    assert val[1]["loss"] < val[0]["loss"]
    log0 = (dump / "logs/rank_0.log").read_text()
    assert "global batch 8 sequences (4 x 2 DP ranks" in log0
    # The tiny shape's parameters by hand: dim 64, 2 layers, 4 heads of 16, 2 KV heads (32
    # wide), SwiGLU hidden int(2 * 4 * 64 / 3) = 170 rounded up to multiple_of 256 = 256.
    dim, kv_dim, hidden, vocab = 64, 2 * 16, 256, 4096
    per_layer = 2 * dim * dim + 2 * dim * kv_dim + 3 * dim * hidden + 2 * dim  # + 2 norms
    n_params = vocab * dim + 2 * per_layer + dim + dim * vocab  # + final norm + output
    assert read_param_counts(dump) == {"total": n_params, "non_embedding": n_params - vocab * dim}
    assert n_params == 647_488
    assert (dump / "logs/rank_1.log").exists()
    resolved = (dump / "config.toml").read_text()
    assert "steps = 20" in resolved and "[parallelism]" in resolved

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(dump / "tb"))
    acc.Reload()
    tb_loss = [e.value for e in acc.Scalars("train/loss")]
    assert tb_loss == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert len(acc.Scalars("validation/loss")) == 2


def test_deterministic_runs_are_bit_identical(runs):
    a, b = runs["a"].check(), runs["b"].check()
    assert a.folder != b.folder
    la = [(r["loss"], r["grad_norm"]) for r in records(a.folder)]
    lb = [(r["loss"], r["grad_norm"]) for r in records(b.folder)]
    assert la == lb


def test_non_finite_loss_stops_the_run_naming_the_step(runs):
    out = runs["nan"]
    assert out.returncode == 1, out.output
    assert "non-finite loss or gradient norm at step 2" in out.output
    train = records(out.folder)
    assert [r["step"] for r in train] == [1, 2]  # logged first, then stopped


def _worker_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes (its children), from /proc."""
    pids = {}
    for children in Path(f"/proc/{launcher}/task").glob("*/children"):
        for pid in children.read_text().split():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ranks = [int(v[5:]) for v in env if v.startswith(b"RANK=")]
            if ranks:
                pids[ranks[0]] = int(pid)
    return pids


def test_sigterm_stops_cleanly_at_a_step_boundary(tmp_path):
    """SIGTERM to one worker: every rank agrees to stop at the same log step, saves the stop
    checkpoint and exits 0, so torchrun exits 0 too. (The signal goes to a worker, as SLURM
    delivers it, not to torchrun: torchrun itself exits 1 whenever it is signalled.)"""
    dump = tmp_path / "term"
    # only the stop saves a checkpoint
    proc = torchrun(dump, "--training.steps", "10000", "--validation.enable", "false",
                    "--checkpoint.enable", "true", "--checkpoint.interval", "1000")  # fmt: skip
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if (dump / "metrics.jsonl").exists() and len(records(dump)) >= 2:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the run never logged two steps")
        workers = _worker_pids(proc.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGTERM)  # rank 0 only learns of it from rank 1
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    logs = [(dump / f"logs/rank_{rank}.log").read_text() for rank in (0, 1)]
    assert "signal 15 received" in logs[1] and "signal 15 received" not in logs[0]
    stops = []
    for log in logs:
        lines = [line for line in log.splitlines() if "stopping at step" in line]
        assert len(lines) == 1 and lines[0].endswith(" on request"), log[-2000:]
        stops.append(int(lines[0].split("stopping at step ")[1].split()[0]))
    step = stops[0]
    assert stops == [step, step] and step >= 2, stops
    for log in logs:
        assert f"done: {step} steps," in log, log[-2000:]
        assert "interrupted" not in log
    assert [r["step"] for r in records(dump)] == list(range(1, step + 1))
    # the stop checkpoint: committed (DCP metadata + layout.json), both ranks' shards
    ckpt = dump / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step-{step}"]
    files = {p.name for p in (ckpt / f"step-{step}").iterdir()}
    assert {".metadata", "layout.json", "__0_0.distcp", "__1_0.distcp"} <= files, files
    layout = json.loads((ckpt / f"step-{step}" / "layout.json").read_text())
    assert (layout["step"], layout["kind"], layout["world_size"]) == (step, "full", 2)
    assert f"checkpoint: saved {ckpt}/step-{step} in" in logs[0]


def test_failed_checkpoint_close_does_not_hide_the_training_error(tmp_path):
    # The run fails at step 3 (after step 2's checkpoint); closing the checkpointer then
    # fails too (patched here): the error the user sees must be the training one.
    dump = tmp_path / "fail"
    boot = (
        "import sys, checkpoint.manager as m\n"
        "from training.launch import run\n"
        "def close(self): raise OSError('close failed: disk gone')\n"
        "m.CheckpointManager.close = close\n"
        "sys.exit(run(sys.argv[1:]))\n"
    )
    cmd = [sys.executable, "-c", boot, *TINY, "--job.dump_folder", str(dump)]
    cmd += ["--training.steps", "4", "--validation.enable", "false", "--debug.fail_at_step", "3"]
    cmd += ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert "failed at step 3" in text and "debug.fail_at_step = 3: injected failure" in text
    assert "closing after the error also failed: close failed: disk gone" in text
    assert "OSError: close failed" not in text  # no traceback ending in the close error
    assert [r["step"] for r in records(dump)] == [1, 2]


def test_megatron_corpus_trains_with_boundaries_from_its_index(tmp_path, pool):
    """A Megatron .bin/.idx corpus (the tests' own writer, published layout) of documents
    with no end-of-document token trains under 2 DP ranks with document masking: the
    boundaries come from the index. Each document counts up (mod 64) from a random id, so the
    loss falls well below ln(4096) as the model learns the ids and "next id = this id + 1"."""
    from megatron_files import write_megatron

    rng = np.random.default_rng(0)
    docs = []
    for _ in range(440):
        first = int(rng.integers(0, 64))
        docs.append([(first + k) % 64 for k in range(int(rng.integers(5, 60)))])
    write_megatron(tmp_path / "corpus", docs[:400])
    write_megatron(tmp_path / "held_out", docs[400:])
    corpus = run(
        "corpus",
        "--training.dataset_path", f"{tmp_path / 'corpus'}.idx",  # the suffix: megatron
        "--training.document_mask", "true", "--training.steps", "16", "--optimizer.lr", "1e-2",
        "--validation.dataset_path", str(tmp_path / "held_out"), "--validation.freq", "16",
        "--validation.steps", "2", nproc=2,
    )  # fmt: skip
    dump = pool.launch(__name__, [corpus])["corpus"].check().folder
    train = records(dump)
    assert records(dump, "validation")[0]["loss"] < train[0]["loss"] - 2.0
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-3:]) / 3
    assert 7.5 < first < 10.0 and last < first - 2.0, (first, last)
    assert "training.dataset = 'megatron' inferred" in (dump / "logs/rank_0.log").read_text()


def test_mixture_logs_each_source_s_tokens(tmp_path, pool):
    """A 3:1 mixture of two Megatron corpora: metrics.jsonl holds each source's tokens so
    far, which add up to tokens_seen and follow the weights at every step, and each source's
    held-out loss (validation.per_source) beside the validation loss."""
    from megatron_files import documents, write_megatron

    for name, seed in (("web", 1), ("code", 2), ("web_val", 3), ("code_val", 4)):
        write_megatron(tmp_path / name, documents(300, seed, vocab=4000))
    mixture = f'["megatron:{tmp_path / "web"}:3", "megatron:{tmp_path / "code"}:1"]'
    held_out = f'["megatron:{tmp_path / "web_val"}", "megatron:{tmp_path / "code_val"}"]'
    mix = run("mix", "--training.mixture", mixture, "--training.steps", "4",
              "--validation.dataset", "megatron", "--validation.dataset_path",
              str(tmp_path / "web_val"), "--validation.per_source", held_out,
              "--validation.freq", "4", "--validation.steps", "2")  # fmt: skip
    dump = pool.launch(__name__, [mix])["mix"].check().folder
    (val,) = records(dump, "validation")
    assert val["loss_mix0"] == pytest.approx(val["loss"]) and val["loss_mix1"] > 0
    for r in records(dump):  # 4 sequences of 32 tokens a step: 3 from web, 1 from code
        assert r["tokens_mix0"] + r["tokens_mix1"] == r["tokens_seen"]
        assert (r["tokens_mix0"], r["tokens_mix1"]) == (96 * r["step"], 32 * r["step"])
