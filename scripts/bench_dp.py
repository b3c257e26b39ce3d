"""DDP vs ZeRO-1 vs ZeRO-2 vs FSDP2 (ZeRO-3) on the same model and data, side by side.

    python scripts/bench_dp.py [--nproc 2] [--steps 20] [--config debug_model] \
        [--stages 0,1,2,3] [--section.key value ...]

Launches one `torchrun --standalone` run of train.py per `parallelism.zero_stage` (one after
the other, so they do not share the machine), reads each run's metrics.jsonl and rank logs,
and prints step time, throughput, peak memory, the parameter/gradient/optimizer bytes every
rank really holds (memory_report after the first step) next to what the estimator predicts
for that layout (parallelisms/estimate.py), and the final loss (equal across stages: the
layout does not change the math).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP2 (ZeRO-3)"}
HELD = re.compile(
    r"held per rank: params ([\d.]+) MiB, grads ([\d.]+) MiB, optimizer state ([\d.]+)"
)


def run_stage(stage: int, ns, extra: list[str]) -> dict:
    folder = Path(ns.output) / f"zero{stage}"
    if folder.exists():
        for p in sorted(folder.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={ns.nproc}", "train.py", "--config", ns.config]
    cmd += ["--job.dump_folder", str(folder), "--parallelism.zero_stage", str(stage)]
    cmd += ["--training.steps", str(ns.steps), "--metrics.log_freq", "1"]
    cmd += ["--validation.enable", "false", "--metrics.enable_tensorboard", "false", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"zero_stage {stage} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    steady = train[min(2, len(train) - 1) :]  # skip start-up steps
    held = []
    for rank in range(ns.nproc):
        m = HELD.search((folder / "logs" / f"rank_{rank}.log").read_text())
        held.append(sum(float(x) for x in m.groups()) if m else float("nan"))
    return {
        "stage": stage,
        "step_s": statistics.median(r["step_time_s"] for r in steady),
        "fwd_bwd_s": statistics.median(r.get("forward_backward_time_s", 0) for r in steady),
        "opt_s": statistics.median(r.get("optimizer_time_s", 0) for r in steady),
        "tok_s": statistics.median(r["tokens_per_sec"] for r in steady),
        "peak_gib": max(r["memory_gib"] for r in train),
        "held_mib": held,
        "loss": train[-1]["loss"],
        "wall_s": time.perf_counter() - t0,
    }


def estimated_mib(stage: int, ns, extra: list[str]) -> float:
    """Parameter + gradient + AdamW bytes per rank that parallelisms/estimate predicts."""
    from config import parse_args
    from models import build_model_args, get_model_spec, shape_overrides
    from parallelisms.estimate import simulate

    cfg = parse_args(["--config", ns.config, "--parallelism.zero_stage", str(stage), *extra])
    args = build_model_args(
        cfg.model.name, cfg.model.flavor, cfg.training.seq_len, None, shape_overrides(cfg.model)
    )
    device = "cuda" if cfg.training.device == "cuda" else "cpu"
    if cfg.training.device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = simulate(get_model_spec(cfg.model.name), args, cfg, ns.nproc, device_type=device)
    return plan.ranks[0].states / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--config", default="debug_model")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--output", default=str(ROOT / "outputs" / "bench_dp"))
    ns, extra = ap.parse_known_args(argv)
    rows = []
    for stage in (int(s) for s in ns.stages.split(",")):
        print(f"running zero_stage {stage} ({NAMES[stage]}) on {ns.nproc} ranks ...", flush=True)
        row = run_stage(stage, ns, extra)
        row["est_mib"] = estimated_mib(stage, ns, extra)
        rows.append(row)
    ranks = " ".join(f"r{r:<7}" for r in range(ns.nproc))
    print(
        f"\n{ns.config}, {ns.nproc} ranks, {ns.steps} steps (medians after 2 start-up steps); "
        "held = params+grads+AdamW state per rank after step 1 (memory_report), est = "
        "parallelisms/estimate.py; peak = rank 0 (CUDA max allocated, CPU process RSS)"
    )
    print(
        f"{'layout':16} {'step s':>7} {'fwd+bwd':>8} {'optim':>7} {'tok/s/dev':>9} "
        f"{'peak GiB':>8}  held MiB: {ranks} {'est MiB':>8} {'final loss':>10}"
    )
    for r in rows:
        held = " ".join(f"{v:<8.1f}" for v in r["held_mib"])
        print(
            f"{NAMES[r['stage']]:16} {r['step_s']:>7.3f} {r['fwd_bwd_s']:>8.3f} "
            f"{r['opt_s']:>7.3f} {r['tok_s']:>9,.0f} {r['peak_gib']:>8.2f}            "
            f"{held} {r['est_mib']:>8.1f} {r['loss']:>10.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
