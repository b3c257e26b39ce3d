"""Checks the attention backends on a device against the dense definition in float64: every
spec (plain causal through SDPA, document masking, sliding window, soft-capping, attention
sinks) with grouped-query heads, forward and backward, in the compute dtype asked for. On CUDA this is
FlexAttention over the model's block masks and SDPA's fused causal kernels; elsewhere the
block-sparse kernel. Prints a Markdown table; exits 1 if a row is off.

    python scripts/attention_check.py --device cuda --dtype bfloat16 [--output FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from models.attention import AttentionSpec, attend, attention_batch
from models.block_attention import visible

SPECS = {
    "causal (SDPA)": AttentionSpec(),
    "document mask": AttentionSpec(),
    "window 256": AttentionSpec(window=256),
    "window 256 + documents": AttentionSpec(window=256),
    "softcap 50, scale 1/16": AttentionSpec(softcap=50.0, scale=1 / 16),
    "sinks, window 256 + documents": AttentionSpec(window=256, sinks=True),
}
# bf16 inputs and outputs against a float64 reference: relative to the output's scale
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def dense(spec, q, k, v, docs, sinks=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * (spec.scale or q.shape[-1] ** -0.5)
    if spec.softcap:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    pos = torch.arange(q.shape[2], device=q.device)[None]
    d = (docs[:, :, None], docs[:, None, :]) if docs is not None else (None, None)
    seen = visible(pos[:, :, None], pos[:, None, :], *d, spec.causal, spec.window)
    s = s.masked_fill(~seen[:, None], float("-inf"))
    if sinks is None:
        return torch.softmax(s, -1) @ v
    column = sinks[None, :, None, None].expand(*s.shape[:3], 1)  # a sink logit per head
    return torch.softmax(torch.cat([s, column], -1), -1)[..., :-1] @ v


def check(name, spec, device, dtype, seq, heads=8, kv_heads=2, dim=64, batch=2):
    g = torch.Generator(device="cpu").manual_seed(0)
    base = [torch.randn(batch, h, seq, dim, generator=g, dtype=torch.float64)
            for h in (heads, kv_heads, kv_heads)]  # fmt: skip
    docs = None
    if "document" in name:
        docs = torch.cumsum((torch.rand(batch, seq, generator=g) < 1 / 300).int(), -1)
        docs = docs.to(device, torch.int32)
    if spec.sinks:
        base.append(torch.randn(heads, generator=g, dtype=torch.float64))
    q, k, v, *sinks = (t.to(device, dtype).requires_grad_() for t in base)
    ab = attention_batch([spec], batch, seq, torch.device(device), documents=docs)
    start = time.perf_counter()
    out = attend(spec, q, k, v, ab, *sinks)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v, *sinks))
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ref_in = [t.to(device).requires_grad_() for t in base]
    ref = dense(spec, *ref_in[:3], docs, *ref_in[3:])
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_in)
    errors = [(a.double() - b).abs().max().item() / b.abs().max().item()
              for a, b in zip((out, *grads), (ref, *ref_grads))]  # fmt: skip
    return errors, seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--output", default="")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    lines = [
        f"Attention backends on {a.device} ({torch.__version__}), {a.dtype}, seq {a.seq}, "
        "8 heads / 2 KV heads, against float64; relative max error of output and dq, dk, dv (and "
        "the sink logits' gradient)",
        "",
        "| spec | out | dq | dk | dv | dsinks | seconds (first call, compile included) | ok |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ok_all = True
    for name, spec in SPECS.items():
        try:
            errors, seconds = check(name, spec, a.device, dtype, a.seq)
            ok = max(errors) < TOLERANCE[dtype]
            cells = " | ".join([f"{e:.1e}" for e in errors] + ["-"] * (5 - len(errors)))
            lines.append(f"| {name} | {cells} | {seconds:.2f} | {'yes' if ok else 'NO'} |")
        except Exception as e:  # a backend that fails on this device: one row says how
            ok = False
            lines.append(f"| {name} | {type(e).__name__}: {str(e)[:120]} | | | | | | NO |")
        ok_all &= ok
    text = "\n".join(lines) + "\n"
    print(text)
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
