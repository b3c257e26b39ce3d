"""Throughput benchmark: meshtrain layouts and a hand-written PyTorch loop, side by side.

    python scripts/bench.py [--rows single_eager,single_compiled,bare] [--repeats 3] \
        [--steps 8] [--warmup 3] [--baseline bare] [--output benchmarks/NAME] \
        [--section.key value ...]          # any train.py override, applied to every row

Every row is one fresh process tree (`train.py`, under torchrun when it has several ranks,
or the `bare` loop), run `--repeats` times, interleaved A B C A B C ... so machine drift hits
every row alike. Each run's steady steps (after `--warmup`) give a median step time; a row
reports the median over its repeats and the spread (min-max of the repeats' tokens/s).

Columns: tokens/s per device (global tokens / world size / step time, as train.py logs it),
step time, achieved TFLOP/s of the whole machine (6N + 12·H·Dh·Σ span FLOPs per token, each
layer's attention at the keys it sees, metrics/flops.py), MFU against a peak measured here in the same
invocation (a dense matmul in the runs' compute dtype on all cores on CPU, plus the bf16 rate
where the CPU has bf16 instructions; on GPUs one GPU's datasheet peak times the row's GPUs),
peak memory
per rank (the largest rank's peak RSS on CPU, from the kernel's rusage of the process tree;
CUDA max allocated on GPUs, from the trainer's log), on CPU that peak less the RSS the rank
had before its model was built (interpreter, libraries, process groups: what no layout can
shard; "peak - runtime"), parameter + gradient + optimizer bytes
held per rank (memory_report after step 1), and the ratio to the baseline row.

Row `bare` is a plain PyTorch loop over the same model class (scripts/bare_loop.py): model,
AdamW (foreach), fp32 cross-entropy, backward, grad-norm clip, step, zero_grad, `loss.item()`
each step (as train.py does at log_freq 1) — no meshtrain code between the batch and the next
batch; with a bf16 compute dtype (`--training.mixed_precision_param bfloat16`) its forward
runs under `torch.autocast`, plain PyTorch's mixed precision.
Threads: single-process rows use all cores; an N-rank row gives each rank cores/N.
Results go to <output>/bench.json and <output>/bench.md with machine, torch, command, date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

# scripts/bench_*.py, next to this file
from bench_measure import (
    ROOT,
    compute_dtype,
    estimated_mib,
    flops_per_token,
    machine,
    measure_peak,
    run_once,
)
from bench_report import kept_notes, render
from bench_rows import DEFAULT_ROWS, ROWS, Row, get_row


@dataclass
class Reference:
    """What every row is measured against: the machine, the model's FLOPs per token and the
    matmul peak in the runs' compute dtype (measured before the runs)."""

    info: dict
    cores: int
    fpt: float
    n_params: int
    sizes: tuple[int, ...]
    dtype: object
    peak: float
    peak_src: str


def parse_cli(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[Row]]:
    """bench.py's own options, the train.py overrides it passes on, and the rows to run."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma list of: {', '.join(ROWS)}")
    ap.add_argument("--config", default="debug_model")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="start-up steps left out of medians")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default="bare", help="row the ratio column divides by")
    ap.add_argument("--output", default=str(ROOT / "outputs" / "bench"))
    ap.add_argument("--title", default="")
    ap.add_argument("--peak-sizes", default="1024,2048", help="CPU matmul sizes for the peak")
    ap.add_argument(
        "--estimate", action="store_true", help="add the estimator's held MiB/rank (est MiB)"
    )
    ns, extra = ap.parse_known_args(argv)
    names = [n.strip() for n in ns.rows.split(",") if n.strip()]
    unknown = [n for n in names if get_row(n) is None]
    if unknown:
        ap.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}, ddp_N, zero[123]_N")
    return ns, extra, [get_row(n) for n in names]


def measure_reference(ns, extra: list[str]) -> Reference:
    """The machine, the model's FLOPs and the peak before the runs, announced in one line."""
    cores = os.cpu_count() or 1
    info = machine()
    fpt, n_params = flops_per_token(["--config", ns.config, *extra])
    sizes = tuple(int(x) for x in ns.peak_sizes.split(","))
    dtype = compute_dtype(["--config", ns.config, *extra])
    peak, peak_src = measure_peak(cores, sizes, dtype)
    print(f"{info['cpu']}, {cores} cores, torch {info['torch']}; peak {peak / 1e12:.3f} "
          f"TFLOP/s ({peak_src}); model {n_params:,} params, {fpt / 1e9:.3f} GFLOP/token",
          flush=True)  # fmt: skip
    return Reference(info, cores, fpt, n_params, sizes, dtype, peak, peak_src)


def run_repeats(
    rows: list[Row], ns, extra: list[str], ref: Reference
) -> tuple[dict[str, list[dict]], float]:
    """Every row `ns.repeats` times, interleaved; (the runs by row, the best peak re-measured
    after each repeat: the best reading is the least disturbed)."""
    runs: dict[str, list[dict]] = {r.name: [] for r in rows}
    peaks_after = []
    for rep in range(ns.repeats):
        for row in rows:
            load = os.getloadavg()[0]
            res = run_once(row, ns, extra, rep)
            res["load_before"] = load
            runs[row.name].append(res)
            print(f"  repeat {rep} {row.name:22} {res['tok_s_dev']:>10,.0f} tok/s/dev  "
                  f"step {res['step_s']:.3f}s  load {load:.1f}  ({res['wall_s']:.0f}s)",
                  flush=True)  # fmt: skip
        peaks_after.append(measure_peak(ref.cores, ref.sizes, ref.dtype, describe=False)[0])
    return runs, max(peaks_after)


def estimates(rows: list[Row], ns, extra: list[str]) -> dict[str, float | None]:
    """The estimator's MiB per rank of each row (None without --estimate). Run after the
    timed runs: a failure here must not lose their numbers, so it leaves the row blank."""
    est = {}
    for r in rows:
        try:
            est[r.name] = estimated_mib(r, ns, extra) if ns.estimate else None
        except Exception as e:  # noqa: BLE001
            print(f"  estimate for {r.name} failed ({type(e).__name__}: {e}); left blank")
            est[r.name] = None
    return est


def run_bench(argv: list[str]) -> int:
    """The benchmark: every row's runs, then the table (printed, bench.json, bench.md)."""
    ns, extra, rows = parse_cli(argv)
    Path(ns.output).mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    ref = measure_reference(ns, extra)
    runs, peak_after = run_repeats(rows, ns, extra, ref)
    payload = {
        "title": ns.title or "meshtrain benchmark",
        "date": started.isoformat(),
        "command": "python scripts/bench.py " + shlex.join(argv),
        # allocator and threading variables change speed and RSS: record any that were set
        "env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_"))},
        "machine": ref.info,
        "peak_flops_before": ref.peak,
        "peak_flops_after": peak_after,
        "peak_source": ref.peak_src,
        "flops_per_token": ref.fpt,
        "flops_formula": "6N + 12·H·Dh·Σ span, each layer at its attention span",
        "params": ref.n_params,
        "config": ns.config,
        "overrides": extra,
        "steps": ns.steps,
        "warmup": ns.warmup,
        "repeats": ns.repeats,
        "baseline": ns.baseline,
        "est_mib": estimates(rows, ns, extra),
        "runs": runs,
    }
    print("\n" + render(payload, Path(ns.output)))
    return 0


def rerender(argv: list[str]) -> int:
    """`--render FOLDER [BASELINE]`: the table of a folder's bench.json again (e.g. with a
    new baseline row), rewriting its bench.json and bench.md; the bench.md's `## Notes`
    section stays (a fresh run writes none: its notes belong to the runs they describe)."""
    folder = Path(argv[0])
    payload = json.loads((folder / "bench.json").read_text())
    if len(argv) > 1:
        payload["baseline"] = argv[1]
    print(render(payload, folder, kept_notes(folder)))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--render":
        return rerender(argv[1:])
    return run_bench(argv)


if __name__ == "__main__":
    sys.exit(main())
