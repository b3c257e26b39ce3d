"""Attention memory and time on CPU: the block masks (models/attention.py) against the dense
document mask they replaced, and grouped-query attention without repeated K/V.

Three measurements, written to benchmarks/attention/bench.md and results.json (not bench.json:
that name is scripts/bench_report.py's):

- `layers`: one attention layer (bf16, batch 1, 4 query heads, 2 K/V heads, head_dim 64) at
  1K-32K tokens: memory = the tensors autograd saves for backward (saved_tensors_hooks, each
  storage once) + the mask's tensors; time = forward + backward. Rows: causal SDPA; the old
  dense document mask (reimplemented here only: a boolean [b, 1, s, s] mask and SDPA over K/V
  repeated to all heads); the block-mask document mask (documents of 2048 tokens); a
  1024-token sliding window. The log-log slope of each row against the length is fitted.
- `model`: tokens/s of the debug model (llama3 debugmodel, fp32) with document masking at
  4K tokens, the block-mask backend against the dense mask (the model's attention cores
  swapped for a dense-mask core), and their losses over the same steps.
- `gqa`: an 8B-shaped attention layer (32 query heads, 8 K/V heads, head_dim 128, bf16) at
  1K tokens: saved bytes and the peak of live tensors during forward + backward (torch's
  MemTracker), with K/V repeated to all heads (before) and at their own size (after).

Memory is deterministic; times depend on the machine's load, written beside them
(`os.getloadavg`). Usage: python scripts/bench_attention.py [--part layers|model|gqa ...]
[--max-dense 32768] [--out benchmarks/attention].
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import functools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent

from models.attention import AttentionCore, AttentionSpec, attend, attention_batch  # noqa: E402

MIB = 2**20
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768]
DOC = 2048  # document length of the document-mask rows
WINDOW = 1024


def load() -> str:
    return "{:.1f}/{:.1f}".format(*os.getloadavg()[:2])


def saved_bytes(fn) -> tuple[object, int]:
    """(fn's result, bytes of the storages autograd saves for backward while it runs)."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def tensor_bytes(*tensors) -> int:
    """Bytes of the distinct storages of `tensors` (None and non-tensors skipped)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def documents(b: int, s: int, length: int) -> torch.Tensor:
    return (torch.arange(s) // length).to(torch.int32).expand(b, -1)


def dense_mask(positions, docs, causal: bool = True) -> torch.Tensor:
    """The old path's [b, 1, s, s] boolean document-causal mask."""
    same = docs[:, :, None] == docs[:, None, :]
    if causal:
        same = same & (positions[:, None, :] <= positions[:, :, None])
    return same[:, None]


def dense_attention(q, k, v, mask):
    """The old path: K/V repeated to all query heads, SDPA with the boolean mask."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def layer_case(name: str, s: int, heads=4, kv_heads=2, dim=64, b=1):
    """(run: a function doing one forward, the mask's bytes) for row `name` at `s` tokens;
    run() returns the output (for backward)."""
    g = torch.Generator().manual_seed(0)

    def x(h):
        return torch.randn(b, h, s, dim, generator=g, dtype=torch.bfloat16).requires_grad_()

    q, k, v = x(heads), x(kv_heads), x(kv_heads)
    pos = torch.arange(s).expand(b, -1)
    if name == "causal SDPA":
        spec = AttentionSpec()
        return (lambda: attend(spec, q, k, v, None)), 0, (q, k, v)
    if name == "dense document mask (old)":
        mask = dense_mask(pos, documents(b, s, DOC))
        return (lambda: dense_attention(q, k, v, mask)), tensor_bytes(mask), (q, k, v)
    spec = AttentionSpec(window=WINDOW) if name.startswith("sliding") else AttentionSpec()
    docs = documents(b, s, DOC) if name.startswith("block") else None
    batch = attention_batch([spec], b, s, torch.device("cpu"), pos, docs)
    m = batch.masks[spec.key]
    mask_bytes = tensor_bytes(*m.as_tuple(), batch.positions, batch.documents)
    return (lambda: attend(spec, q, k, v, batch)), mask_bytes, (q, k, v)


LAYER_ROWS = [
    "causal SDPA",
    "dense document mask (old)",
    f"block-mask document mask ({DOC}-token documents)",
    f"sliding window {WINDOW}",
]


def run_layers(lengths: list[int], max_dense: int, reps: int) -> list[dict]:
    rows = []
    for name in LAYER_ROWS:
        for s in lengths:
            if name.startswith("dense") and s > max_dense:
                continue
            run, mask_bytes, inputs = layer_case(name, s)
            out, saved = saved_bytes(run)
            del out
            times = []
            for _ in range(reps if s <= 8192 else 1):
                for t in inputs:
                    t.grad = None
                t0 = time.perf_counter()
                run().float().sum().backward()
                times.append(time.perf_counter() - t0)
            row = {"row": name, "s": s, "saved": saved, "mask": mask_bytes,
                   "memory": saved + mask_bytes, "seconds": min(times), "load": load()}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def slope(xs, ys) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# ----------------------------------------------------------------------------- model
class DenseCore(nn.Module):
    """The old path as an attention core: the [b, 1, s, s] mask built once per micro-batch
    from the batch's positions and documents (kept while the batch lives), K/V repeated."""

    cache: dict = {}

    def __init__(self, spec: AttentionSpec):
        super().__init__()
        self.spec = spec

    def forward(self, q, k, v, batch=None):
        key = id(batch)
        if key not in DenseCore.cache:
            DenseCore.cache.clear()
            DenseCore.cache[key] = dense_mask(batch.positions, batch.documents)
        return dense_attention(q, k, v, DenseCore.cache[key])


def doc_tokens(b: int, s: int, eos: int, vocab: int, seed: int) -> torch.Tensor:
    """Packed sequences: documents of 256-2048 tokens (seeded), each ending with `eos`."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (b, s + 1), generator=g)
    for row in tokens:
        i = 0
        while True:
            i += int(torch.randint(256, 2049, (1,), generator=g))
            if i >= s:
                break
            row[i] = eos
    return tokens


def run_model(s: int, steps: int, b: int) -> dict:
    from models import build_model_args, get_model_spec
    from models.init_weights import materialize

    spec = get_model_spec("llama3")
    args = build_model_args("llama3", "debugmodel", s)
    with torch.device("meta"):
        meta = spec.model_cls(args)
    base = materialize(meta, 42, "cpu")
    eos = 2
    batches = [doc_tokens(b, s, eos, args.vocab_size, i) for i in range(steps)]
    out = {"s": s, "batch": b, "steps": steps, "shape": f"llama3 debugmodel {vars(args)}"}
    for backend in ("block mask", "dense mask (old)"):
        model = copy.deepcopy(base)
        if backend.startswith("dense"):
            for block in model.layers.values():
                block.attention.core = DenseCore(block.attention.core.spec)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses, times = [], []
        for tokens in batches:
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            ends = (inputs == eos).to(torch.int32)  # each synthetic document ends with eos
            docs = ends.cumsum(-1, dtype=torch.int32) - ends
            pos = torch.arange(s).expand(b, -1)
            t0 = time.perf_counter()
            logits = model(inputs, positions=pos, documents=docs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        timed = times[1:]  # the first step warms up
        out[backend] = {"losses": losses, "step_seconds": timed,
                        "tokens_per_s": b * s * len(timed) / sum(timed), "load": load()}  # fmt: skip
        print(backend, json.dumps(out[backend]), flush=True)
    a, d = out["block mask"]["losses"], out["dense mask (old)"]["losses"]
    out["max_loss_difference"] = max(abs(x - y) for x, y in zip(a, d))
    return out


# ------------------------------------------------------------------------------- gqa
class Layer(nn.Module):
    def __init__(self, repeat: bool):
        super().__init__()
        self.repeat = repeat
        self.core = AttentionCore()

    def forward(self, q, k, v):
        if self.repeat:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return self.core(q, k, v)


def run_gqa(s: int) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    out = {"s": s, "shape": "batch 1, n_heads 32, n_kv_heads 8, head_dim 128, bf16"}
    for name, repeat in (("K/V repeated (before)", True), ("K/V at kv heads (after)", False)):
        g = torch.Generator().manual_seed(0)

        def x(h, g=g):
            return torch.randn(1, h, s, 128, generator=g, dtype=torch.bfloat16).requires_grad_()

        q, k, v = x(32), x(8), x(8)
        layer = Layer(repeat)
        o, saved = saved_bytes(functools.partial(layer, q, k, v))
        del o
        inputs = tensor_bytes(q, k, v)
        tracker = MemTracker()
        tracker.track_external(layer)
        with tracker:
            layer(q, k, v).float().sum().backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        total = int(sum(int(b) for kind, b in peak.items() if "Total" not in str(kind)))
        out[name] = {"saved": saved, "inputs": inputs, "peak_live": total,
                     "peak_by_kind": {str(getattr(k, 'value', k)): int(b) for k, b in peak.items()}}  # fmt: skip
        print(name, json.dumps(out[name]), flush=True)
    return out


# ------------------------------------------------------------------------------ report
def machine() -> str:
    return (
        f"{platform.system()} {platform.release()} {platform.machine()}, "
        f"{os.cpu_count()} cores (shared), torch {torch.__version__}"
    )


def table(title: str, head: list[str], rows: list[list[str]]) -> list[str]:
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def report(data: dict) -> str:
    lines = [
        "# Attention memory and time: block masks vs the dense document mask (issue #25)",
        "",
        f"- date: {data['date']}",
        f"- machine: {data['machine']}",
        f"- command: `{data['command']}`",
        "- memory: the tensors autograd saves for backward (saved_tensors_hooks, each storage "
        "once, q/k/v included) + the mask's tensors; deterministic. Time: forward + backward, "
        "best of 3 (1 at 16K+); the machine is shared, `load` is the 1/5-minute load average "
        "when the row ran (2 cores).",
        "",
    ]
    if "layers" in data:
        rows = [
            [r["row"], f"{r['s']:,}", f"{r['saved'] / MIB:.2f}", f"{r['mask'] / MIB:.3f}",
             f"{r['memory'] / MIB:.2f}", f"{r['seconds']:.3f}", r["load"]]
            for r in data["layers"]
        ]  # fmt: skip
        head = ["row", "tokens", "saved MiB", "mask MiB", "memory MiB", "fwd+bwd s", "load"]
        title = "## One attention layer (bf16, batch 1, 4 query heads, 2 K/V heads, head_dim 64)"
        lines += table(title, head, rows)
        fits = [[name, f"{f['memory']:.2f}", f"{f['time']:.2f}", f["lengths"]]
                for name, f in data["slopes"].items()]  # fmt: skip
        title = "Log-log slopes against the length (1 linear, 2 quadratic):"
        lines += table(title, ["row", "memory slope", "time slope", "lengths"], fits)
    if "model" in data:
        m = data["model"]
        rows = [
            [backend, f"{m[backend]['tokens_per_s']:.0f}",
             ", ".join(f"{t:.2f}" for t in m[backend]["step_seconds"]),
             ", ".join(f"{x:.5f}" for x in m[backend]["losses"]), m[backend]["load"]]
            for backend in ("block mask", "dense mask (old)")
        ]  # fmt: skip
        title = (
            f"## Debug model (llama3 debugmodel, fp32), document masking, {m['s']:,} tokens x "
            f"batch {m['batch']}, AdamW, {m['steps']} steps (the first untimed)"
        )
        lines += table(title, ["backend", "tokens/s", "step s", "losses", "load"], rows)
        lines += [f"Largest loss difference: {m['max_loss_difference']:.2e}.", ""]
    if "gqa" in data:
        q = data["gqa"]
        rows = [
            [name, f"{q[name]['saved'] / MIB:.1f}", f"{q[name]['peak_live'] / MIB:.1f}",
             f"{q[name]['inputs'] / MIB:.1f}"]
            for name in ("K/V repeated (before)", "K/V at kv heads (after)")
        ]  # fmt: skip
        title = f"## Grouped-query attention, 8B-shaped layer ({q['shape']}), {q['s']:,} tokens"
        head = ["K/V", "saved for backward MiB", "peak of live tensors, fwd+bwd MiB", "q, k, v MiB"]
        lines += table(title, head, rows)
        lines += [
            "Peak: torch's MemTracker over one forward + backward (q, k, v and their "
            "gradients included).",
            "",
        ]
    if data.get("notes"):  # written by hand into results.json after a run
        lines += ["## Notes", "", *data["notes"], ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", action="append", choices=["layers", "model", "gqa"])
    p.add_argument("--render", action="store_true", help="re-render bench.md from results.json")
    p.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    p.add_argument("--max-dense", type=int, default=32768)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model-seq", type=int, default=4096)
    p.add_argument("--model-steps", type=int, default=4)
    p.add_argument("--model-batch", type=int, default=1)
    p.add_argument("--gqa-seq", type=int, default=1024)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "attention"))
    ns = p.parse_args(argv)
    parts = ns.part if ns.part is not None else ["layers", "model", "gqa"]
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    if ns.render:
        (out / "bench.md").write_text(report(data))
        return 0
    data.update(
        date=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine(),
        command="python scripts/bench_attention.py " + " ".join(argv or sys.argv[1:]),
    )
    if "layers" in parts:
        data["layers"] = run_layers(ns.lengths, ns.max_dense, ns.reps)
        data["slopes"] = {}
        for name in LAYER_ROWS:
            rows = [r for r in data["layers"] if r["row"] == name]
            xs = [r["s"] for r in rows]
            data["slopes"][name] = {
                "memory": slope(xs, [r["memory"] for r in rows]),
                "time": slope(xs, [r["seconds"] for r in rows]),
                "lengths": f"{xs[0]:,}-{xs[-1]:,}",
            }
    if "model" in parts:
        data["model"] = run_model(ns.model_seq, ns.model_steps, ns.model_batch)
    if "gqa" in parts:
        data["gqa"] = run_gqa(ns.gqa_seq)
    path.write_text(json.dumps(data, indent=1) + "\n")
    (out / "bench.md").write_text(report(data))
    print(report(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
