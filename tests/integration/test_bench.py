"""Smoke test of scripts/bench.py: a tiny model, the bare loop, one and two ranks, one repeat.
Checks the table's shape and files only (no timing assertions)."""

import json
import subprocess
import sys
from pathlib import Path

from dist_utils import TINY_SHAPE

from metrics.peak_flops import cpu_bf16_flags

ROOT = Path(__file__).resolve().parents[2]
TINY = [*TINY_SHAPE, "--training.seq_len", "32", "--training.local_batch_size", "2"]


def test_bench_smoke(tmp_path):
    cmd = [sys.executable, "scripts/bench.py", "--rows", "bare,single_eager,zero3_2"]
    cmd += ["--steps", "2", "--warmup", "1", "--repeats", "1", "--estimate"]
    cmd += ["--peak-sizes", "256"]
    cmd += ["--output", str(tmp_path), *TINY]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["row"]: r for r in data["rows"]}
    assert list(rows) == ["bare", "single_eager", "zero3_2"]
    assert data["peak_flops"] > 0 and data["flops_per_token"] > 0
    # fp32 runs: MFU against the fp32 matmul rate; the bf16 rate beside it where the CPU has it
    assert data["peak_source"].startswith("measured fp32 256x256 matmul")
    assert ("; bf16 (" in data["peak_source"]) == bool(cpu_bf16_flags())
    for r in rows.values():
        assert r["tok_s_dev"] > 0 and r["step_s"] > 0 and r["peak_mem_gib"] > 0
        assert r["mfu_pct"] > 0
    assert rows["zero3_2"]["ranks"] == 2 and rows["zero3_2"]["held_mib"] > 0
    # meshtrain rows also split off the runtime's share of the peak RSS; the bare loop cannot
    assert rows["bare"]["run_mem_gib"] is None
    for name in ("single_eager", "zero3_2"):
        assert 0 < rows[name]["run_mem_gib"] < rows[name]["peak_mem_gib"]
    # the estimator predicts exactly what FSDP2 holds (parameters + gradients + AdamW)
    assert abs(rows["zero3_2"]["held_mib"] - rows["zero3_2"]["est_mib"]) < 0.2
    md = (tmp_path / "bench.md").read_text()
    assert "vs bare" in md and "command:" in md and "machine:" in md
    assert all(f"| {name} |" in md for name in rows)


def test_bench_bf16_compute_measures_a_bf16_peak(tmp_path):
    # bf16 compute: MFU is against a bf16 matmul rate, and the bare loop runs under autocast
    # (same weights and tokens as in fp32, so its loss moves only by bf16 rounding)
    def bench(out, *args):
        cmd = [sys.executable, "scripts/bench.py", "--steps", "2", "--warmup", "1"]
        cmd += ["--repeats", "1", "--peak-sizes", "256", "--output", str(out), *TINY, *args]
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        return json.loads((out / "bench.json").read_text())

    data = bench(tmp_path / "bf16", "--rows", "bare,single_eager",
                 "--training.mixed_precision_param", "bfloat16")  # fmt: skip
    cores = data["machine"]["cores"]
    assert data["peak_source"] == f"measured bf16 256x256 matmul, {cores} threads"
    assert all(r["mfu_pct"] > 0 and 0 < r["loss"] < 20 for r in data["rows"])
    fp32 = bench(tmp_path / "fp32", "--rows", "bare")
    bare_bf16, bare_fp32 = data["rows"][0]["loss"], fp32["rows"][0]["loss"]
    assert bare_bf16 != bare_fp32 and abs(bare_bf16 - bare_fp32) < 0.05 * bare_fp32
