"""Block-sparse attention in plain PyTorch, for devices without FlexAttention's backward (CPU:
torch 2.13's FlexAttention refuses to differentiate there), and the block structure of a mask
that both this kernel and FlexAttention read.

The block structure (`block_sparsity`) is computed from block-level bounds of the queries' and
keys' positions and documents: a key block is *partial* for a query block when some pair may be
visible and *full* when every pair is; the exact per-token rule (`visible`) is applied inside
partial blocks only. Its size grows with (tokens / block)^2 integers, FlexAttention's own
layout; no [queries, keys] tensor is built anywhere.

The kernel (`block_attention`, a custom op, so it stays one node in compiled graphs) loops over
query blocks: each attends to the keys of its visible blocks with an online-softmax-free exact
softmax over them, saving only the output and the log-sum-exp per query; the backward recomputes
each block's probabilities (flash attention's recipe), so what attention keeps for backward is
q, k, v, the output and one float per query and head, linear in the sequence. The log-sum-exp
is an output with a gradient of its own (attention sinks and families that read it use it).
Grouped-query heads attend as [kv_heads, group x queries] without repeating K/V.
"""

from __future__ import annotations

import torch
from torch import Tensor


def visible(q_pos, k_pos, q_doc, k_doc, causal: bool, window: int | None):
    """Whether a key at `k_pos` (in document `k_doc`) is visible to a query at `q_pos`
    (elementwise, broadcasting; documents None: no document mask)."""
    ok = k_pos <= q_pos if causal else torch.ones_like(k_pos <= q_pos)
    if window is not None:
        ok = ok & (q_pos - k_pos < window)
    if q_doc is not None:
        ok = ok & (q_doc == k_doc)
    return ok


def _bounds(x: Tensor, size: int) -> tuple[Tensor, Tensor]:
    blocks = x.unflatten(1, (-1, size))  # [batch, blocks, size]
    return blocks.amin(-1), blocks.amax(-1)


def block_sparsity(
    q_pos: Tensor,
    k_pos: Tensor,
    q_doc: Tensor | None,
    k_doc: Tensor | None,
    size: int,
    causal: bool,
    window: int | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) as FlexAttention's
    BlockMask holds them ([batch, 1, query blocks(, key blocks)], int32, visible blocks first):
    positions [batch, tokens] of any order (context parallelism's chunks), documents numbered
    in position order (packed sequences); `size` divides both lengths."""
    qmin, qmax = (t[:, :, None] for t in _bounds(q_pos, size))
    kmin, kmax = (t[:, None, :] for t in _bounds(k_pos, size))
    some = torch.ones(qmin.shape[0], qmin.shape[1], kmin.shape[2], dtype=torch.bool,
                      device=q_pos.device)  # fmt: skip
    every = some.clone()
    if causal:
        some, every = some & (kmin <= qmax), every & (kmax <= qmin)
    if window is not None:
        some, every = some & (qmin - kmax < window), every & (qmax - kmin < window)
    if q_doc is not None:
        qd0, qd1 = (t[:, :, None] for t in _bounds(q_doc, size))
        kd0, kd1 = (t[:, None, :] for t in _bounds(k_doc, size))
        some = some & (kd0 <= qd1) & (kd1 >= qd0)
        every = every & (qd0 == qd1) & (kd0 == kd1) & (qd0 == kd0)
    partial = some & ~every
    return (*_blocks_first(partial), *_blocks_first(every))


def _blocks_first(chosen: Tensor) -> tuple[Tensor, Tensor]:
    count = chosen.sum(-1, dtype=torch.int32)[:, None]
    order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count, order[:, None]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _block_keys(num, idx, full_num, full_idx, b: int, i: int, size: int):
    """Key token indices of query block i of row b (partial blocks, then full ones), and how
    many of them are in partial blocks."""
    partial = idx[b, 0, i, : int(num[b, 0, i])]
    full = full_idx[b, 0, i, : int(full_num[b, 0, i])]
    offsets = torch.arange(size, device=idx.device)
    blocks = torch.cat([partial, full]).long()
    return (blocks[:, None] * size + offsets).flatten(), partial.numel() * size


def _scores(qb, kb, scale, softcap):
    """Scores of a query block [kv_heads, group x size, dim] against keys [kv_heads, keys,
    dim], soft-capped; also tanh's value (for the backward)."""
    s = torch.matmul(qb, kb.transpose(-1, -2)) * scale
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return softcap * t, t


def _blocks(q, k, v, num, idx, full_num, full_idx, q_pos, k_pos, q_doc, k_doc, causal,
            window, size):  # fmt: skip
    """Yields per (row, query block): the slices and the masked-out pairs, shaped for
    grouped-query heads ([kv_heads, group x size, ...])."""
    batch, heads, q_len, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    for b in range(batch):
        for i in range(q_len // size):
            rows = slice(i * size, (i + 1) * size)
            keys, n_partial = _block_keys(num, idx, full_num, full_idx, b, i, size)
            pk = keys[:n_partial]
            hidden = ~visible(
                q_pos[b, rows, None], k_pos[b, pk][None], None if q_doc is None else
                q_doc[b, rows, None], None if k_doc is None else k_doc[b, pk][None],
                causal, window,
            )  # fmt: skip
            hidden = torch.cat([hidden, hidden.new_zeros(size, keys.numel() - n_partial)], 1)
            yield b, rows, keys, hidden, group, kv_heads, dim


def _group(x: Tensor, kv_heads: int, dim: int) -> Tensor:
    """[heads, size, dim] -> [kv_heads, group x size, dim] (head h reads kv head h // group)."""
    return x.reshape(kv_heads, -1, dim)


def _output_like(q: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """An uninitialised [batch, heads, queries, dim] tensor (the values' head size, which may
    differ from the queries': MLA) in q's memory order: the layers' q is a transposed [batch,
    seq, heads, dim] tensor, and an output in that order reaches the output projection without
    a copy."""
    order = sorted(range(q.dim()), key=lambda d: (-q.stride(d), d))
    return torch.empty_permuted((*q.shape[:3], dim), order, dtype=dtype, device=q.device)


@torch.library.custom_op("meshtrain::block_attention", mutates_args=())
def _forward(
    q: Tensor, k: Tensor, v: Tensor, num: Tensor, idx: Tensor, full_num: Tensor,
    full_idx: Tensor, q_pos: Tensor, k_pos: Tensor, q_doc: Tensor | None,
    k_doc: Tensor | None, causal: bool, window: int, softcap: float, scale: float, size: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    work = _work_dtype(q.dtype)
    out = _output_like(q, v.shape[-1], work).zero_()
    lse = torch.zeros(q.shape[:3], dtype=work, device=q.device)
    cap = softcap or None
    for b, rows, keys, hidden, group, kv_heads, dim in _blocks(
        q, k, v, num, idx, full_num, full_idx, q_pos, k_pos, q_doc, k_doc, causal,
        window or None, size,
    ):  # fmt: skip
        qb = _group(q[b, :, rows].to(work), kv_heads, dim)
        s, _ = _scores(qb, k[b, :, keys].to(work), scale, cap)
        s = s.unflatten(1, (group, -1)).masked_fill(hidden, float("-inf")).flatten(1, 2)
        m = torch.logsumexp(s, dim=-1, keepdim=True)
        o = torch.matmul(torch.exp(s - m), v[b, :, keys].to(work))
        out[b, :, rows] = o.reshape(-1, rows.stop - rows.start, v.shape[-1])
        lse[b, :, rows] = m.reshape(-1, rows.stop - rows.start)
    return out.to(q.dtype), lse


@_forward.register_fake
def _(q, k, v, num, idx, full_num, full_idx, q_pos, k_pos, q_doc, k_doc, causal, window,
      softcap, scale, size):  # fmt: skip
    # the kernel's memory order (compiled code asserts the real output has the fake's strides)
    out = _output_like(q, v.shape[-1], q.dtype)
    return out, q.new_empty(q.shape[:3], dtype=_work_dtype(q.dtype))


@torch.library.custom_op("meshtrain::block_attention_backward", mutates_args=())
def _backward(
    grad: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, num: Tensor, idx: Tensor, full_num: Tensor, full_idx: Tensor, q_pos: Tensor,
    k_pos: Tensor,
    q_doc: Tensor | None, k_doc: Tensor | None, causal: bool, window: int, softcap: float,
    scale: float, size: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    work = _work_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(x, dtype=work) for x in (q, k, v))  # their memory order
    cap = softcap or None
    for b, rows, keys, hidden, group, kv_heads, dim in _blocks(
        q, k, v, num, idx, full_num, full_idx, q_pos, k_pos, q_doc, k_doc, causal,
        window or None, size,
    ):  # fmt: skip
        n = rows.stop - rows.start
        qb = _group(q[b, :, rows].to(work), kv_heads, dim)
        kb, vb = k[b, :, keys].to(work), v[b, :, keys].to(work)
        gb = _group(grad[b, :, rows].to(work), kv_heads, v.shape[-1])
        ob = _group(out[b, :, rows].to(work), kv_heads, v.shape[-1])
        s, t = _scores(qb, kb, scale, cap)
        s = s.unflatten(1, (group, -1)).masked_fill(hidden, float("-inf")).flatten(1, 2)
        p = torch.exp(s - lse[b, :, rows].reshape(kv_heads, group * n, 1))
        dv[b, :, keys] += torch.matmul(p.transpose(-1, -2), gb)
        dp = torch.matmul(gb, vb.transpose(-1, -2))
        # d out / d s = p (dp - rowsum(g o)); d lse / d s = p
        delta = (gb * ob).sum(-1, keepdim=True)
        if grad_lse is not None:
            delta = delta - grad_lse[b, :, rows].to(work).reshape(kv_heads, group * n, 1)
        ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1 - t * t)
        dq[b, :, rows] = torch.matmul(ds, kb).reshape(-1, n, dim) * scale
        dk[b, :, keys] += torch.matmul(ds.transpose(-1, -2), qb) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_backward.register_fake
def _(grad, grad_lse, q, k, v, out, lse, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # as the kernel


def _setup(ctx, inputs, output) -> None:
    q, k, v, *masks = inputs[:11]
    ctx.save_for_backward(q, k, v, output[0], output[1], *masks[:6])
    ctx.docs = masks[6:8]  # may be None (not saveable as tensors)
    ctx.options = inputs[11:]


def _grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse, num, idx, full_num, full_idx, q_pos, k_pos = ctx.saved_tensors
    dq, dk, dv = _backward(
        grad_out.contiguous(), grad_lse, q, k, v, out, lse, num, idx, full_num, full_idx, q_pos,
        k_pos, *ctx.docs, *ctx.options,
    )  # fmt: skip
    return (dq, dk, dv) + (None,) * 13


_forward.register_autograd(_grad, setup_context=_setup)


def block_attention(
    q: Tensor, k: Tensor, v: Tensor, mask, q_pos: Tensor, k_pos: Tensor,
    q_doc: Tensor | None, k_doc: Tensor | None, causal: bool, window: int | None,
    softcap: float | None, scale: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """softmax(softcap(scale q k^T) masked) v over the visible blocks of `mask` (a BlockMask
    built by models.attention.block_mask), and the log-sum-exp of each query's visible scores
    ([batch, heads, queries], at least float32): q [batch, heads, queries, dim], k [batch,
    kv_heads, keys, dim], v [batch, kv_heads, keys, value dim] (any size: MLA's values are
    smaller than its keys); positions and documents [batch, tokens]."""
    size = mask.BLOCK_SIZE[0]
    return _forward(
        q, k, v, mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
        mask.full_kv_indices, q_pos, k_pos, q_doc, k_doc, causal, window or 0,
        float(softcap or 0.0), float(scale), size,
    )  # fmt: skip
