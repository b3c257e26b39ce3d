"""Muon's owner-computes exchange against gathering every matrix on every rank, measured.

Launches the debug model (llama3 debugmodel, fp32, 2 steps, Muon) at several layouts on gloo
and reads rank 0's optimizer line: the elements its two all_to_alls receive per step (the
split sizes the exchange really passes to `all_to_all_single`) and what an all-gather of every
sharded matrix would receive on that rank, plus the optimizer's step time (2nd step). Prints a
markdown table (benchmarks/muon/README.md records one, with the machine and the date).

Usage: python scripts/bench_muon.py [--layouts fsdp2 fsdp4 fsdp8 tp2_fsdp2 tp2_fsdp4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# layout -> (ranks, train.py arguments)
LAYOUTS = {
    "fsdp2": (2, []),
    "fsdp4": (4, []),
    "fsdp8": (8, []),
    "tp2_fsdp2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    "tp2_fsdp4": (8, ["--parallelism.tensor_parallel_degree", "2"]),
}
LINE = re.compile(r"receiving ([\d,]+) elements a step here \(gathering every matrix: ([\d,]+)\)")


def measure(name: str, folder: Path) -> dict:
    nproc, extra = LAYOUTS[name]
    dump = folder / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "train.py", "--config", "debug_model",
           "--optimizer.name", "Muon", "--training.steps", "2", "--training.device", "cpu",
           "--training.mixed_precision_param", "float32", "--validation.enable", "false",
           "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump), *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    log = (dump / "logs" / "rank_0.log").read_text()
    ours, everywhere = (int(x.replace(",", "")) for x in LINE.search(log).groups())
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    step2 = next(r for r in records if r.get("kind") == "train" and r["step"] == 2)
    return {"layout": name, "ranks": nproc, "owner": ours, "everywhere": everywhere,
            "optimizer_s": step2["optimizer_time_s"]}  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = ["| layout | ranks | received per step, owner-computes | gathering every matrix | "
             "ratio | optimizer step s |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        ratio = r["owner"] / r["everywhere"] if r["everywhere"] else float("nan")
        lines.append(f"| {r['layout']} | {r['ranks']} | {r['owner']:,} | {r['everywhere']:,} | "
                     f"{ratio:.2f} | {r['optimizer_s']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, Path(tmp)) for name in args.layouts]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
