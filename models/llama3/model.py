"""Llama 3 in plain PyTorch: no parallelism, no trainer imports; fork this file freely.

What is Llama's own: its args (SwiGLU width from `multiple_of` and the multiplier), RoPE in
Meta's interleaved convention with Llama 3.1's frequency scaling, and its initialisation. The
decoder shell, the grouped-query attention, SwiGLU and the pre-norm block are the ones every
family shares (models/blocks.py): layers in a ModuleDict keyed by layer index, so a pipeline
stage is this model with other layers deleted while checkpoint keys stay stable. Weights are
created on any device (meta included); `init_param` says how each one is initialised and
`init_buffers` fills the RoPE table, so every layout materialises the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from models.blocks import Decoder, FeedForward, GroupedQueryAttention, PreNormBlock
from models.rope import apply_interleaved, cos_sin_table, inverse_frequencies, llama3_scaled


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: one key/value head per query head (no grouping)
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = False  # Llama 3.1 long-context frequency scaling
    rope_scaling_factor: float = 8.0  # how much it stretches the low frequencies (3.2: 32)
    tie_embeddings: bool = False  # output projection = token embeddings (Llama 3.2 1B/3B)
    max_seq_len: int = 8192
    depth_init: bool = True  # output-projection std shrinks with depth

    def __post_init__(self) -> None:
        """Shapes the layers cannot be built with fail here, not inside attention."""
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        problems = []
        if self.dim % self.n_heads:
            problems.append(f"dim = {self.dim} is not a multiple of n_heads = {self.n_heads}")
        elif self.head_dim % 2:
            problems.append(
                f"head_dim = dim / n_heads = {self.head_dim} is odd (RoPE rotates pairs)"
            )
        if self.n_heads % self.n_kv_heads:
            problems.append(
                f"n_heads = {self.n_heads} is not a multiple of n_kv_heads = {self.n_kv_heads} "
                "(each key/value head serves n_heads / n_kv_heads query heads)"
            )
        if problems:
            raise ValueError("model shape: " + "; ".join(problems) + ".")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, times the multiplier, rounded up to multiple_of."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def rope_frequencies(args: ModelArgs, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), with Llama 3.1's scaling of the low frequencies
    (models/rope.py; computed in float64, returned in `dtype`)."""
    inv_freq = inverse_frequencies(args.head_dim, args.rope_theta)
    if args.use_scaled_rope:
        inv_freq = llama3_scaled(inv_freq, args.rope_scaling_factor)
    return inv_freq.to(dtype)


def rope_table(
    args: ModelArgs, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[max_seq_len, head_dim // 2, 2] (cos, sin) table in `dtype`, the angles in `dtype` as
    Meta's reference computes them (float32; float64 for a float64 model)."""
    inv_freq = rope_frequencies(args, dtype)
    return cos_sin_table(inv_freq, args.max_seq_len, device, dtype, angles_in_float64=False)


class Attention(GroupedQueryAttention):
    """Grouped-query causal self-attention, Meta's interleaved RoPE."""

    def __init__(self, args: ModelArgs):
        super().__init__(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, apply_interleaved)


class TransformerBlock(PreNormBlock):
    def __init__(self, args: ModelArgs):
        super().__init__(
            Attention(args), FeedForward(args.dim, args.ffn_hidden_dim), args.dim, args.norm_eps
        )


class Transformer(Decoder):
    rope_table = staticmethod(rope_table)

    def __init__(self, args: ModelArgs):
        super().__init__(args, [TransformerBlock(args) for _ in range(args.n_layers)])

    def init_param(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Initialises the full (unsharded) value of parameter `name` in place.

        Truncated normals (cut at 3 std) of std 0.02 for the input projections, a depth-scaled
        std for the projections that write into the residual stream (wo, w2, w3, as in Llama
        practice), dim^-0.5 for the output layer, N(0, 1) embeddings (N(0, 0.02²) when they
        are also the output projection) and unit norm weights.
        """
        a = self.args
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
            return
        if name == "tok_embeddings.weight":  # tied, it is also the output projection
            std = 0.02 if a.tie_embeddings else 1.0
            nn.init.normal_(tensor, std=std, generator=generator)
            return
        if name == "output.weight":
            std = a.dim**-0.5
        elif name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight")):
            std = 0.02
        elif name.endswith(("wo.weight", "w2.weight", "w3.weight")):
            layer_id = int(name.split(".")[1])
            std = 0.02 / math.sqrt(2 * (layer_id + 1) if a.depth_init else 2 * a.n_layers)
        else:
            raise ValueError(f"init_param: no initialisation rule for parameter '{name}'")
        nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
