"""Throughput benchmark: meshtrain layouts and a hand-written PyTorch loop, side by side.

    python scripts/bench.py [--rows single_eager,single_compiled,bare] [--repeats 3] \
        [--steps 8] [--warmup 3] [--baseline bare] [--output benchmarks/NAME] \
        [--section.key value ...]          # any train.py override, applied to every row

Every row is one fresh process tree (`train.py`, under torchrun when it has several ranks,
or the `bare` loop), run `--repeats` times, interleaved A B C A B C ... so machine drift hits
every row alike. Each run's steady steps (after `--warmup`) give a median step time; a row
reports the median over its repeats and the spread (min-max of the repeats' tokens/s).

Columns: tokens/s per device (global tokens / world size / step time, as train.py logs it),
step time, achieved TFLOP/s of the whole machine (6N + 12·L·H·Dh·S FLOPs per token, causal
attention at full cost, metrics/flops.py), MFU against a peak measured here in the same
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
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BARE_LOOP = Path(__file__).resolve().with_name("bare_loop.py")  # the `bare` row

HELD = re.compile(
    r"held per rank: params ([\d.]+) MiB, grads ([\d.]+) MiB, optimizer state ([\d.]+)"
)
PP_SCHEDULES = ["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"]
PP_SCHEDULES += ["ZBVZeroBubble", "DualPipeV"]  # V schedules: on CPU, torch >= 2.13


@dataclass
class Row:
    name: str
    nproc: int = 1
    args: list[str] = field(default_factory=list)
    bare: bool = False
    note: str = ""


def _rows() -> dict[str, Row]:
    z = "--parallelism.zero_stage"
    rows = [
        Row("bare", bare=True, note="hand-written PyTorch loop, same model"),
        Row("single_eager", note="train.py, 1 process"),
        Row("single_compiled", args=["--compile.enable", "true"], note="regional compile"),
        Row(
            "single_foreach_adamw",
            args=["--optimizer.implementation", "foreach"],
            note="foreach AdamW (the bare loop's kernel; auto takes fused)",
        ),
        Row("single_ac_full", args=["--activation_checkpoint.mode", "full"]),
        Row("single_ac_selective", args=["--activation_checkpoint.mode", "selective"]),
        Row("ddp_2", 2, [z, "0"], note="DDP"),
        Row("zero1_2", 2, [z, "1"], note="ZeRO-1"),
        Row("zero2_2", 2, [z, "2"], note="ZeRO-2"),
        Row("zero3_2", 2, [z, "3"], note="FSDP2 (ZeRO-3)"),
        Row("zero3_offload_2", 2, [z, "3", "--training.enable_cpu_offload", "true"]),
        Row(
            "ep2_2",
            2,
            [z, "3", "--parallelism.expert_parallel_degree", "2"],
            note="MoE: EP 2 (experts split, all-to-all), FSDP2 over the rest",
        ),
        Row("ddp_4", 4, [z, "0"], note="DDP"),
        Row("zero3_4", 4, [z, "3"], note="FSDP2 (ZeRO-3)"),
        Row(
            "tp_2",
            2,
            [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
            ],
            note="TP 2 + loss parallel",
        ),
    ]
    for s in PP_SCHEDULES:
        rows.append(
            Row(
                f"pp_2_{s}",
                2,
                [
                    "--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "1",
                    "--parallelism.pipeline_parallel_schedule", s,
                ],
                note=f"PP 2, {s}",
            )
        )  # fmt: skip
    return {r.name: r for r in rows}


ROWS = _rows()
DEFAULT_ROWS = "bare,single_eager,single_compiled"
DP_ROW = re.compile(r"^(ddp|zero1|zero2|zero3)_(\d+)$")
DP_NOTES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "FSDP2 (ZeRO-3)"}


def get_row(name: str) -> Row | None:
    """A named row, or a data-parallel row at any rank count: ddp_N, zero1_N, zero2_N, zero3_N."""
    if name in ROWS:
        return ROWS[name]
    m = DP_ROW.match(name)
    if not m:
        return None
    stage = "0" if m[1] == "ddp" else m[1][-1]
    return Row(name, int(m[2]), ["--parallelism.zero_stage", stage], note=DP_NOTES[m[1]])


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
    args = model_args_for(cfg.model, cfg.training.seq_len, vocab_size(cfg))
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
    from parallelisms.mixed_precision import mixed_precision_dtypes
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
    args = model_args_for(cfg.model, cfg.training.seq_len, vocab_size(cfg))
    with torch.device("meta"):
        model = get_model_spec(cfg.model.name).model_cls(args)
    n = count_params(model, exclude_embedding=True)
    return fpt(n, args.n_layers, args.n_heads, args.head_dim, cfg.training.seq_len), count_params(
        model
    )


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


def summarise(row: Row, runs: list[dict], fpt: float, peak: float, cuda: bool) -> dict:
    """A row's medians; `peak` is the CPU machine's, or one GPU's (times the row's ranks)."""
    tok = [r["tok_s_dev"] for r in runs]
    tok_med = statistics.median(tok)
    achieved = tok_med * row.nproc * fpt
    if cuda:
        peak *= row.nproc
    return {
        "row": row.name,
        "note": row.note,
        "ranks": row.nproc,
        "tok_s_dev": tok_med,
        "tok_s_min": min(tok),
        "tok_s_max": max(tok),
        "spread_pct": 100 * (max(tok) - min(tok)) / tok_med if tok_med else 0.0,
        "best_tok_s_dev": max(r["best_tok_s_dev"] for r in runs),
        "step_s": statistics.median(r["step_s"] for r in runs),
        "first_step_s": statistics.median(r["first_step_s"] for r in runs),
        "tflops": achieved / 1e12,
        "mfu_pct": 100 * achieved / peak if peak else 0.0,
        "peak_mem_gib": max(r["logged_mem_gib" if cuda else "rss_gib"] for r in runs),
        "run_mem_gib": max(
            (r["run_mem_gib"] for r in runs if r["run_mem_gib"] is not None), default=None
        ),  # fmt: skip
        "held_mib": runs[0]["held_mib"],
        "loss": runs[-1]["loss"],
        "repeats": len(runs),
    }


def table(results: list[dict], baseline: str | None) -> list[str]:
    base = next((r for r in results if r["row"] == baseline), None)
    head = (
        f"| row | ranks | tok/s/dev | spread | step s | TFLOP/s | MFU % | peak mem/rank GiB "
        f"| peak - runtime GiB | held MiB/rank | est MiB | vs {baseline or '-'} | best tok/s/dev | best vs "
        f"{baseline or '-'} | first step s | final loss |"
    )
    lines = [head, "|" + "---|" * 16]
    for r in results:
        ratio = f"{r['tok_s_dev'] / base['tok_s_dev']:.3f}" if base else "-"
        best = f"{r['best_tok_s_dev'] / base['best_tok_s_dev']:.3f}" if base else "-"
        held = f"{r['held_mib']:.1f}" if r["held_mib"] is not None else "-"
        est = f"{r['est_mib']:.1f}" if r.get("est_mib") is not None else "-"
        run_mem = f"{r['run_mem_gib']:.2f}" if r.get("run_mem_gib") is not None else "-"
        lines.append(
            f"| {r['row']} | {r['ranks']} | {r['tok_s_dev']:,.0f} | ±{r['spread_pct'] / 2:.1f}% "
            f"| {r['step_s']:.3f} | {r['tflops']:.3f} | {r['mfu_pct']:.1f} "
            f"| {r['peak_mem_gib']:.2f} | {run_mem} | {held} | {est} | {ratio} | {r['best_tok_s_dev']:,.0f} "
            f"| {best} | {r['first_step_s']:.2f} "
            f"| {r['loss']:.4f} |"
        )
    return lines


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
    new baseline row), rewriting its bench.json and bench.md."""
    folder = Path(argv[0])
    payload = json.loads((folder / "bench.json").read_text())
    if len(argv) > 1:
        payload["baseline"] = argv[1]
    print(render(payload, folder))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--render":
        return rerender(argv[1:])
    return run_bench(argv)


def render(payload: dict, folder: Path) -> str:
    """Summarises the raw runs into the table and writes bench.json and bench.md. The peak
    is the better of the two matmul measurements (before and after the runs): on a shared
    machine either may be depressed by other load, and a low peak would inflate MFU."""
    p = payload
    peak = max(p["peak_flops_before"], p["peak_flops_after"])
    rows = [get_row(name) for name in p["runs"]]
    cuda = bool(p["machine"].get("gpu"))
    results = [summarise(r, p["runs"][r.name], p["flops_per_token"], peak, cuda) for r in rows]
    for res in results:
        res["est_mib"] = p["est_mib"].get(res["row"])
    loads = [x["load_before"] for v in p["runs"].values() for x in v]
    info = p["machine"]
    header = [
        f"# {p['title']}",
        "",
        f"- date: {p['date'][:16].replace('T', ' ')} UTC",
        f"- machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, "
        f"{info['gpu'] or 'no GPU'}; {info['platform']}",
        f"- torch {info['torch']}, Python {info['python']}",
        f"- command: `{p['command']}`"
        + "".join(f" with {k}={v}" for k, v in sorted(p.get("env", {}).items())),
        f"- model: config {p['config']} {' '.join(p['overrides'])}: {p['params']:,} parameters, "
        f"{p['flops_per_token'] / 1e9:.3f} GFLOP/token (6N + 12·L·H·Dh·S, causal at full cost)",
        f"- peak: {peak / 1e12:.3f} TFLOP/s ({p['peak_source']}; best of "
        f"{p['peak_flops_before'] / 1e12:.3f} before the runs and {p['peak_flops_after'] / 1e12:.3f} "
        "after repeats); MFU = all ranks' model FLOP/s / this peak"
        + (" x the row's GPUs" if cuda else ""),
        f"- {p['steps']} steps per run, medians over steps {p['warmup'] + 1}-{p['steps']}, then "
        f"the median over {p['repeats']} interleaved repeats; spread = half the min-max range; "
        "best = the fastest steady step of any repeat (least disturbed by other load)",
        f"- 1-minute load average before each run: {min(loads):.1f}-{max(loads):.1f}",
        "",
    ]
    md = "\n".join(header + table(results, p["baseline"] if p["baseline"] in p["runs"] else None))
    out = {**p, "peak_flops": peak, "rows": results}
    (folder / "bench.json").write_text(json.dumps(out, indent=1) + "\n")
    (folder / "bench.md").write_text(md + "\n")
    return md


if __name__ == "__main__":
    sys.exit(main())
