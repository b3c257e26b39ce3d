"""What scripts/bench.py measures: the machine, the matmul peak, the model's FLOPs per token
and the estimator's memory, and one run of a row (its step times, peak memory and held bytes
from the run's metrics and logs)."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench_rows import Row

ROOT = Path(__file__).resolve().parent.parent
BARE_LOOP = Path(__file__).resolve().with_name("bare_loop.py")  # the `bare` row

HELD = re.compile(
    r"held per rank: params ([\d.]+) MiB, grads ([\d.]+) MiB, optimizer state ([\d.]+)"
)


def vocab_size(cfg) -> int:
    """The vocabulary train.py would build the model with (its tokenizer's)."""
    from training.trainer import load_tokenizer

    return load_tokenizer(cfg).vocab_size


def estimated_mib(row: Row, ns, extra: list[str]) -> float | None:
    """Parameter + gradient + AdamW MiB per rank that planning/simulate predicts."""
    if row.bare:
        return None
    import torch

    from job_config import parse_args
    from models import get_model_spec, model_args_for
    from planning.simulate import simulate

    cfg = parse_args(["--config", ns.config, *extra, *row.args])
    args = model_args_for(cfg, cfg.training.seq_len, vocab_size(cfg))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = simulate(get_model_spec(cfg.model.name), args, cfg, row.nproc, device_type=device)
    return plan.ranks[0].states / 2**20


def machine() -> dict:
    import torch

    from metrics.peak_flops import cpu_model_name

    info = {
        "cpu": cpu_model_name(),
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def compute_dtype(overrides: list[str]):
    """The matmul dtype train.py will compute in with these overrides on this machine."""
    from job_config import parse_args
    from models.mixed_precision import mixed_precision_dtypes
    from training.distributed import device_type

    cfg = parse_args(overrides)
    return mixed_precision_dtypes(cfg.training, device_type(cfg.training.device))[0]


def measure_peak(
    cores: int, sizes: tuple[int, ...], dtype, describe: bool = True
) -> tuple[float, str]:
    """Peak FLOP/s for matmuls in `dtype` (the runs' compute dtype): on CPU the machine's, the
    best square-matmul rate on all cores (sizes 1024-2048, a few seconds) — where the CPU has
    bf16 instructions and the runs compute in fp32, the bf16 rate is measured too and shown
    beside it; on CUDA one GPU's datasheet peak, with a measured 8192 matmul rate beside it
    (a row's MFU divides by it times the row's ranks). `describe=False` (the re-measurements
    after each repeat, whose description is not shown) skips the side rates."""
    import torch

    from metrics.peak_flops import cpu_bf16_flags, lookup_gpu_peak, measure_matmul_flops

    name_of = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64"}
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        dev = torch.device("cuda", 0)
        rate = measure_matmul_flops(dev, dtype, 8192, iters=10, time_budget_s=2.0)
        torch.cuda.empty_cache()  # the runs are child processes: leave them the memory
        measured = f"measured {name_of[dtype]} 8192 matmul {rate / 1e12:.0f} TFLOP/s"
        peak = lookup_gpu_peak(name, dtype)
        if peak is None:  # no datasheet entry: the measured rate is the best peak there is
            return rate, f"per GPU: {measured} ({name} has no datasheet entry)"
        return peak, f"per GPU: datasheet {name_of[dtype]} {peak / 1e12:.0f} TFLOP/s; {measured}"
    torch.set_num_threads(cores)

    def best_rate(dt) -> tuple[float, int]:
        rates = [(measure_matmul_flops(torch.device("cpu"), dt, n, iters=5), n) for n in sizes]
        return max(rates)

    best, best_size = best_rate(dtype)
    text = f"measured {name_of[dtype]} {best_size}x{best_size} matmul, {cores} threads"
    flags = cpu_bf16_flags() if describe else []
    if flags and dtype == torch.float32:
        bf16, bf16_size = best_rate(torch.bfloat16)
        text += f"; bf16 ({', '.join(flags)}) {bf16 / 1e12:.3f} TFLOP/s at {bf16_size}"
    return best, text


def flops_per_token(overrides: list[str]) -> tuple[float, int]:
    """(FLOPs per token, parameters) of the configured model, counted on the meta device."""
    import torch

    from job_config import parse_args
    from metrics import count_params
    from metrics import flops_per_token as fpt
    from models import get_model_spec, model_args_for

    cfg = parse_args(overrides)
    args = model_args_for(cfg, cfg.training.seq_len, vocab_size(cfg))
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(args)
    from planning.memory import layer_attention_specs

    n = count_params(model, spec.embeddings)
    layers = layer_attention_specs(model)
    per_token = fpt(n, args.n_layers, args.n_heads, args.head_dim, cfg.training.seq_len, layers)
    return per_token, count_params(model)


def _command(row: Row, ns, extra: list[str], folder: Path) -> tuple[list[str], dict]:
    cores = os.cpu_count() or 1
    threads = max(1, cores // row.nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    common = ["--config", ns.config, "--job.dump_folder", str(folder)]
    common += ["--training.steps", str(ns.steps), "--metrics.log_freq", "1"]
    common += ["--validation.enable", "false", "--metrics.enable_tensorboard", "false"]
    common += [*extra, *row.args]
    if row.bare:
        return [sys.executable, str(BARE_LOOP), *common], env
    if row.nproc == 1:
        return [sys.executable, "train.py", *common], env
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launch, f"--nproc_per_node={row.nproc}", "train.py", *common], env


def run_once(row: Row, ns, extra: list[str], repeat: int) -> dict:
    folder = Path(ns.output) / "runs" / f"{row.name}.{repeat}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cmd, env = _command(row, ns, extra, folder)
    t0 = time.perf_counter()
    with open(folder / "stdout.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        # wait4: the rusage of the whole tree (torchrun waits for its workers), so ru_maxrss
        # is the largest peak RSS of any process in it, i.e. the biggest rank's.
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode:
        tail = (folder / "stdout.txt").read_text()[-3000:]
        raise RuntimeError(f"row {row.name} failed (rc {proc.returncode}):\n{tail}")
    records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind", "train") == "train"]
    steady = train[min(ns.warmup, len(train) - 1) :]
    held = []
    for log in sorted((folder / "logs").glob("rank_*.log")) if (folder / "logs").exists() else []:
        m = HELD.search(log.read_text())
        if m:
            held.append(sum(float(x) for x in m.groups()))
    memory = [r for r in records if r.get("kind") == "memory"]
    if not held and memory:  # no rank log: the memory record of step 1
        held = [memory[0]["total_gib"] * 1024]
    logged_mem = max(r.get("memory_gib", 0.0) for r in train)  # rank 0's peak
    before_model = memory[0].get("rss_before_model_gib") if memory else None
    return {
        "step_s": statistics.median(r["step_time_s"] for r in steady),
        "tok_s_dev": statistics.median(r["tokens_per_sec"] for r in steady),
        "best_tok_s_dev": max(r["tokens_per_sec"] for r in steady),
        "first_step_s": train[0]["step_time_s"],
        "loss": train[-1]["loss"],
        "rss_gib": usage.ru_maxrss * 1024 / 2**30,
        "logged_mem_gib": logged_mem,
        # CPU: rank 0's peak RSS less its RSS before the model was built (the runtime's share)
        "run_mem_gib": logged_mem - before_model if before_model is not None else None,
        "held_mib": max(held) if held else None,
        "wall_s": wall,
    }
