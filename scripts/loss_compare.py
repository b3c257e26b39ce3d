"""Compares the per-step losses (or another metric) of two or more runs.

    python scripts/loss_compare.py outputs/ref outputs/tp2 outputs/fsdp4 [--key loss]
        [--rtol 1e-4]

Each argument is a run's dump folder (or its metrics.jsonl). Prints one row per step with
every run's value and, for each run after the first, its relative difference to the first;
then the largest relative difference per run. With --rtol, exits 1 when any run differs by
more than that (or misses steps the first run has).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metric(path: str | Path, key: str = "loss", kind: str = "train") -> dict[int, float]:
    """{step: value} of `key` from a run folder's (or file's) metrics.jsonl records of `kind`."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == kind and key in rec:
            out[int(rec["step"])] = float(rec[key])
    return out


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def compare(series: dict[str, dict[int, float]]) -> tuple[list[str], dict[str, float]]:
    """Table lines and, per run after the first, its largest relative difference to the first
    (inf when it lacks a step the first has)."""
    names = list(series)
    base = series[names[0]]
    width = max(12, *(len(n) for n in names))
    header = f"{'step':>5} " + " ".join(f"{n:>{width}}" for n in names)
    header += "".join(f" {'rel ' + n:>{width + 4}}" for n in names[1:])
    lines, worst = [header], {n: 0.0 for n in names[1:]}
    for step in sorted(set().union(*(s.keys() for s in series.values()))):
        cells, diffs = [], []
        for n in names:
            v = series[n].get(step)
            cells.append(f"{v:>{width}.6f}" if v is not None else f"{'-':>{width}}")
        for n in names[1:]:
            a, b = base.get(step), series[n].get(step)
            if a is None or b is None:
                d = float("inf") if a is not None else 0.0
                diffs.append(f"{'-':>{width + 4}}")
            else:
                d = rel_diff(a, b)
                diffs.append(f"{d:>{width + 4}.2e}")
            worst[n] = max(worst[n], d)
        lines.append(f"{step:>5} " + " ".join(cells) + " " + " ".join(diffs))
    return lines, worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", help="run dump folders or metrics.jsonl files")
    p.add_argument("--key", default="loss", help="metric to compare (default: loss)")
    p.add_argument("--kind", default="train", help="record kind (default: train)")
    p.add_argument("--rtol", type=float, default=None, help="fail above this relative diff")
    a = p.parse_args(argv)
    if len(a.runs) < 2:
        p.error("give at least two runs")
    series = {}
    for i, r in enumerate(a.runs):
        name = Path(r).name if Path(r).is_dir() else Path(r).parent.name
        series[name if name not in series else f"{name}#{i}"] = read_metric(r, a.key, a.kind)
    lines, worst = compare(series)
    print("\n".join(lines))
    for name, d in worst.items():
        print(f"largest relative difference of {name}: {d:.3e}")
    if a.rtol is not None and any(d > a.rtol for d in worst.values()):
        print(f"FAIL: above rtol {a.rtol:g}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
