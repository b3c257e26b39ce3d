"""The attention core the families share: softmax(q k^T / sqrt(d) + mask) v over grouped
query heads. Plain PyTorch, no parallelism.

A family's attention module projects q, k, v, applies RoPE and calls a
`ScaledDotProductAttention` submodule with the step's attention mask. Keeping this step a
module of its own is the model contract's one hook for sequence-splitting parallelisms:
context parallelism (parallelisms/context_parallel.py) swaps the module for one that first
gathers the keys and values of the whole sequence. A family whose attention goes through it
gets context parallelism and document masking without code of its own.

The mask: None is plain causal attention over the rank's whole sequence (`is_causal=True`,
SDPA's fused causal kernels). Otherwise a boolean [batch, 1, queries, keys] tensor (True =
visible), built once per micro-batch by the trainer (`parallelisms.context_parallel.
sequence_inputs`) and shared by every layer: the document-causal mask (under CP, between the
rank's queries and the gathered keys). SDPA takes it on CPU (math/flash kernels) and CUDA
(memory-efficient kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """q [batch, heads, queries, head_dim]; k, v [batch, kv_heads, keys, head_dim], each key /
    value head serving heads / kv_heads query heads (grouped-query attention, SDPA's
    `enable_gqa`: k and v are never repeated to the query heads in memory, so backward keeps
    them at their own size, and a parallelism that moves them moves the smaller tensors);
    mask as the module doc says."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class ScaledDotProductAttention(nn.Module):
    """No weights: `attend` over the rank's sequence (see the module doc)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return attend(q, k, v, mask)
