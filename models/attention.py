"""Attention as part of the model contract: each attention layer declares what it computes as
data (`AttentionSpec`), and one core (`AttentionCore`) computes it. Plain PyTorch, no
parallelism.

A family's attention module projects q, k, v, applies RoPE and calls its `AttentionCore`
submodule with the micro-batch's `AttentionBatch` (or None). Keeping this step a module of its
own is the contract's one hook for sequence-splitting parallelisms: context parallelism
(parallelisms/context_parallel.py) swaps the core for one that first gathers the keys and
values of the whole sequence and then computes the same spec.

Backends, chosen per spec and device (docs/adding_a_model.md#attention):
- plain causal attention (no window, no soft-cap) without document masking: SDPA's fused
  causal kernels (`is_causal`), grouped-query heads through `enable_gqa` (no repeated K/V);
- everything else goes through a block mask (`AttentionBatch.masks`, built once per micro-batch
  from positions and document ids, shared by every layer with the same spec; no [seq, seq]
  tensor): on CUDA FlexAttention (compiled, `score_mod` for soft-capping); elsewhere the
  block-sparse kernel in models/block_attention.py, because torch's FlexAttention has no
  backward on CPU (torch 2.13: "FlexAttention does not support backward on CPU").
Both masked backends return each query's log-sum-exp with a gradient, which attention sinks
(`AttentionSpec.sinks`) and a family that reads the log-sum-exp (`returns_lse`) use, so nothing
about the sequence is computed outside the core (context parallelism splits only the core).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from models.block_attention import block_attention, block_sparsity, visible

BLOCK = 128  # the block masks' block size (tokens), FlexAttention's default


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer computes: softmax(softcap(scale q k^T) + mask) v, with key j
    visible to query i when (causal) its position is not later, (window) the query is fewer
    than `window` positions after it (itself included: a window of 1 sees only itself), and
    (with `training.document_mask`, if `document_mask`) both are in the same document.

    `sinks` (gpt-oss): each query head has a learned logit that joins its softmax's normaliser
    and carries no value, so a query may attend to "nothing": the output above times
    sigmoid(lse - sink), lse the log-sum-exp of the head's visible scores. The core owns the
    logits (a parameter of `n_heads`; tensor parallelism shards it with the heads).
    `returns_lse`: the core returns (output, lse [batch, heads, queries]), lse over the
    visible keys (the sink not included), for a family that needs it."""

    causal: bool = True
    scale: float | None = None  # the softmax scale; None: 1 / sqrt(head_dim)
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap) (Gemma 2)
    window: int | None = None  # sliding window, in tokens
    document_mask: bool = True  # whether document masking applies to this layer
    sinks: bool = False  # a learned sink logit per query head
    returns_lse: bool = False  # the core also returns the log-sum-exp

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"AttentionSpec.window = {self.window}: at least 1 (or None)")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"AttentionSpec.softcap = {self.softcap}: positive (or None)")

    @property
    def key(self) -> str:
        """A name of the spec's mask (its masks are shared by layers with the same key)."""
        return f"causal={self.causal} window={self.window} documents={self.document_mask}"

    @property
    def fused_causal(self) -> bool:
        """Computable by SDPA's causal kernels when no document mask applies (SDPA returns no
        log-sum-exp, which sinks and `returns_lse` need)."""
        plain = self.causal and self.window is None and self.softcap is None
        return plain and not self.sinks and not self.returns_lse


@dataclass
class AttentionBatch:
    """The attention coordinates of one micro-batch, built once (`attention_batch`) and read
    by every layer: each query's and key's position and document ([batch, tokens]; the keys
    are the queries unless context parallelism gathered others), and the block masks by
    spec key."""

    positions: torch.Tensor
    key_positions: torch.Tensor
    documents: torch.Tensor | None = None
    key_documents: torch.Tensor | None = None
    keys_given: bool = False  # keys other than the queries (context parallelism)
    masks: dict[str, BlockMask] = field(default_factory=dict)

    def documents_apply(self, spec: AttentionSpec) -> bool:
        return self.documents is not None and spec.document_mask

    def needs_mask(self, spec: AttentionSpec) -> bool:
        return not spec.fused_causal or self.documents_apply(spec) or self.keys_given


def attention_specs(model: nn.Module) -> list[AttentionSpec]:
    """The distinct specs of a model's attention cores (any module with a `spec`), in order."""
    specs = [m.spec for m in model.modules() if isinstance(getattr(m, "spec", None), AttentionSpec)]
    return list(dict.fromkeys(specs))


def attention_batch(
    specs: list[AttentionSpec],
    batch: int,
    seq: int,
    device: torch.device,
    positions: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    key_documents: torch.Tensor | None = None,
) -> AttentionBatch | None:
    """The micro-batch's `AttentionBatch`, with a block mask for each spec that needs one; None
    when every layer is plain causal over its own sequence (SDPA needs nothing)."""
    cp = key_positions is not None
    if documents is None and not cp and all(s.fused_causal for s in specs):
        return None
    if positions is None:
        positions = torch.arange(seq, device=device).expand(batch, -1)
    out = AttentionBatch(
        positions,
        positions if key_positions is None else key_positions,
        documents,
        documents if key_documents is None else key_documents,
        keys_given=cp,
    )
    for spec in specs:
        if out.needs_mask(spec) and spec.key not in out.masks:
            out.masks[spec.key] = block_mask(spec, out)
    return out


def block_mask(spec: AttentionSpec, batch: AttentionBatch) -> BlockMask:
    """The spec's block mask over the batch's queries and keys, from block-level bounds of their
    positions and documents (`block_sparsity`): no [queries, keys] tensor is built."""
    docs = batch.documents_apply(spec)
    q_docs, k_docs = (batch.documents, batch.key_documents) if docs else (None, None)
    q_len, k_len = batch.positions.shape[1], batch.key_positions.shape[1]
    size = math.gcd(BLOCK, q_len, k_len)
    sparsity = block_sparsity(
        batch.positions, batch.key_positions, q_docs, k_docs, size, spec.causal, spec.window
    )
    q_pos, k_pos = batch.positions, batch.key_positions

    def mask_mod(b, h, q_idx, kv_idx):
        qd = None if q_docs is None else q_docs[b, q_idx]
        kd = None if k_docs is None else k_docs[b, kv_idx]
        return visible(q_pos[b, q_idx], k_pos[b, kv_idx], qd, kd, spec.causal, spec.window)

    return BlockMask.from_kv_blocks(
        *sparsity, BLOCK_SIZE=size, mask_mod=mask_mod, seq_lengths=(q_len, k_len)
    )


_compiled_flex = None


def _flex(*args, **kwargs) -> torch.Tensor:
    """FlexAttention, compiled once (eager FlexAttention computes the dense scores)."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(*args, **kwargs)


def attend(
    spec: AttentionSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: AttentionBatch | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q [batch, heads, queries, head_dim]; k, v [batch, kv_heads, keys, head_dim] (grouped
    query heads: head i reads kv head i // (heads / kv_heads), never repeated in memory);
    `batch` None: causal over the sequence (see the module doc for the backends); `sinks`
    [heads]: the sink logits of `spec.sinks`. Returns the output, and with `spec.returns_lse`
    the log-sum-exp of the visible scores too."""
    if batch is None or not batch.needs_mask(spec):
        if not spec.fused_causal:
            raise ValueError(f"{spec} needs the micro-batch's AttentionBatch (attention_batch)")
        return fused_causal(q, k, v, spec.scale)
    out, lse = _masked(spec, q, k, v, batch)
    if spec.sinks:
        out = with_sinks(out, lse, sinks)
    return (out, lse) if spec.returns_lse else out


def fused_causal(q, k, v, scale: float | None = None, mask=None) -> torch.Tensor:
    """SDPA's fused kernels (causal, or with `mask`). Values of another head size than the
    queries' (MLA) are zero-padded to it and the output cut back: the fused kernels need one
    head size, and SDPA's fallback would build the [queries, keys] scores."""
    width = v.shape[-1]
    if width < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - width))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return out[..., :width] if out.shape[-1] != width else out


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention output renormalised with a sink logit per head in the softmax's denominator:
    exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink) per query (at least float32)."""
    kept = torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])
    return (out * kept[..., None]).to(out.dtype)


def _masked(spec, q, k, v, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp through the spec's block mask: FlexAttention on CUDA (with
    its log-sum-exp only where used), the block kernel elsewhere."""
    mask = batch.masks[spec.key]
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    if q.is_cuda:
        cap = spec.softcap
        score_mod = None if cap is None else (lambda s, b, h, i, j: cap * torch.tanh(s / cap))
        flex = functools.partial(
            _flex, q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=True
        )
        if not (spec.sinks or spec.returns_lse):
            return flex(), None
        out, aux = flex(return_aux=AuxRequest(lse=True))
        return out, aux.lse
    docs = batch.documents_apply(spec)
    return block_attention(
        q, k, v, mask, batch.positions, batch.key_positions,
        batch.documents if docs else None, batch.key_documents if docs else None,
        spec.causal, spec.window, spec.softcap, scale,
    )  # fmt: skip


class AttentionCore(nn.Module):
    """`attend` with the layer's spec over the rank's sequence (module doc). Its one possible
    weight: the sink logits of `spec.sinks` ([n_heads], named `sinks`)."""

    def __init__(self, spec: AttentionSpec | None = None, n_heads: int | None = None):
        super().__init__()
        self.spec = spec if spec is not None else AttentionSpec()
        if self.spec.sinks:
            if n_heads is None:
                raise ValueError("AttentionCore: AttentionSpec(sinks=True) needs n_heads")
            self.sinks = nn.Parameter(torch.empty(n_heads))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: AttentionBatch | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`sinks`: the sink logits of this rank's heads, given by a parallelism that splits
        the heads (models/tp_plan.py); by default the core's own."""
        if sinks is None and self.spec.sinks:
            sinks = self.sinks
        return attend(self.spec, q, k, v, batch, sinks)

    def extra_repr(self) -> str:
        return repr(self.spec)
