"""DDP vs ZeRO-1 vs ZeRO-2 vs FSDP2 (ZeRO-3) on the same model and data, side by side: a
preset of scripts/bench.py (rows ddp_N, zero1_N, zero2_N, zero3_N, ratios to DDP, the
estimator's held bytes per rank beside the measured ones, final losses equal across stages).

    python scripts/bench_dp.py [--nproc 2] [--steps 20] [--config debug_model] \\
        [--stages 0,1,2,3] [--repeats 1] [--section.key value ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import bench  # scripts/bench.py, next to this file

ROOT = Path(__file__).resolve().parent.parent

NAMES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--output", default=str(ROOT / "outputs" / "bench_dp"))
    ns, extra = ap.parse_known_args(argv)
    rows = [f"{NAMES[int(s)]}_{ns.nproc}" for s in ns.stages.split(",")]
    args = ["--rows", ",".join(rows), "--baseline", rows[0], "--estimate"]
    args += ["--steps", str(ns.steps), "--warmup", "2", "--repeats", str(ns.repeats)]
    args += ["--output", ns.output, "--title", "DDP vs ZeRO-1/2 vs FSDP2", *extra]
    return bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
