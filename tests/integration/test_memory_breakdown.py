"""scripts/memory_breakdown.py on real 2-rank gloo runs: the live-tensor peak by kind shows
DDP holding the full states, ZeRO-3 half of them and TP half the parameters, and bad
layouts fail with a message."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from dist_utils import ROOT, TINY_CONFIG, _env

from job_config import parse_args
from models import get_model_spec, model_args_for
from training.trainer import load_tokenizer

SCRIPT = ROOT / "scripts" / "memory_breakdown.py"


def _run(tmp_path, nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(SCRIPT), "--config", str(TINY_CONFIG), *args]
    return subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )


def test_zero3_and_tp_peaks_hold_half_the_parameters_of_ddp_at_two_ranks(tmp_path):
    cfg = parse_args(["--config", str(TINY_CONFIG)])
    args = model_args_for(cfg, cfg.training.seq_len, load_tokenizer(cfg).vocab_size)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in get_model_spec("llama3").model_cls(args).parameters())
    kinds = {}
    layouts = {
        "ddp": ["--parallelism.zero_stage", "0"],
        "fsdp": ["--parallelism.zero_stage", "3"],
        "tp": ["--parallelism.tensor_parallel_degree", "2"],  # loss parallel, as train.py
    }
    for name, args in layouts.items():
        out = tmp_path / f"{name}.json"
        proc = _run(tmp_path, 2, *args, "--output", str(out))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "| rank |" in proc.stdout
        ranks = json.loads(out.read_text())["ranks"]
        assert len(ranks) == 2
        kinds[name] = ranks[0]["kinds"]
    ddp, fsdp = kinds["ddp"], kinds["fsdp"]
    # TP 2 shards every weight matrix (the norms stay whole): about half the parameters
    assert 0.45 * ddp["Parameter"] < kinds["tp"]["Parameter"] < 0.55 * ddp["Parameter"]
    assert ddp["Parameter"] == 4 * n_params  # fp32, replicated
    assert ddp["Optstate"] >= 2 * 4 * n_params  # exp_avg + exp_avg_sq (+ step counters)
    assert fsdp["Sharded Param"] == 4 * n_params // 2  # this model's shards are even
    assert abs(fsdp["OptState"] - ddp["Optstate"] / 2) < 0.01 * ddp["Optstate"]
    assert "Unsharded Param" in fsdp  # gathered blocks in flight, seen by FSDPMemTracker
    assert fsdp["Total"] < ddp["Total"]


def test_unsupported_and_invalid_layouts_fail_with_a_message(tmp_path):
    proc = _run(tmp_path, 1, "--parallelism.tensor_parallel_degree", "3")
    assert proc.returncode == 2
    assert "memory_breakdown:" in proc.stderr and "tensor" in proc.stderr
    proc = _run(tmp_path, 1, "--compile.enable", "true")
    assert proc.returncode != 0 and "compiled kernels are not tracked" in proc.stderr
