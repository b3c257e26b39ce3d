"""The tables of scripts/bench.py: a row's medians over its repeats, the markdown table, and
bench.json / bench.md with the machine, command and date."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench_rows import Row, get_row  # scripts/bench_rows.py, next to this file

# the FLOPs convention of payloads recorded before each layer's attention span was counted (#25)
OLD_FLOPS = "6N + 12·L·H·Dh·S, causal at full cost"


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


NOTES_HEADING = "## Notes"


def kept_notes(folder: Path) -> str:
    """The hand-written part of a folder's bench.md, from its `## Notes` heading to the end
    (results measured beside the table: profiles, earlier invocations, one-off comparisons),
    which re-tabulating the same runs keeps; "" when there is none."""
    md = folder / "bench.md"
    text = md.read_text() if md.exists() else ""
    at = text.find("\n" + NOTES_HEADING + "\n")
    return text[at + 1 :] if at >= 0 else ""


def render(payload: dict, folder: Path, notes: str = "") -> str:
    """Summarises the raw runs into the table and writes bench.json and bench.md (with
    `notes`, a `kept_notes` text, after the table). The peak is the better of the two matmul
    measurements (before and after the runs): on a shared machine either may be depressed by
    other load, and a low peak would inflate MFU."""
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
        f"{p['flops_per_token'] / 1e9:.3f} GFLOP/token ({p.get('flops_formula', OLD_FLOPS)})",
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
    (folder / "bench.md").write_text(md + "\n" + ("\n" + notes if notes else ""))
    return md
