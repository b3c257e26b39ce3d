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
    """q [batch, heads, queries, head_dim]; k, v [batch, kv_heads, keys, head_dim], repeated
    here to the query heads (grouped-query attention: a parallelism that moves k and v moves
    the smaller tensors); mask as the module doc says."""
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


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
