"""Qwen3 (dense) in plain PyTorch: no parallelism, no trainer imports.

What differs from Llama 3: RMSNorm over each head's query and key (QK-norm) before RoPE, a
head dimension set on its own (not dim / n_heads), RoPE in the rotate-half convention
(the first and second halves of a head are the pairs, as in the Hugging Face checkpoints),
theta 1e6, and optionally the output projection tied to the token embeddings.

The decoder shell, attention, SwiGLU and block are the shared ones (models/blocks.py): blocks in
a ModuleDict keyed by layer index, and
`tok_embeddings` / `norm` / `output` set to None on pipeline stages that lack them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.blocks import Decoder, FeedForward, GroupedQueryAttention, PreNormBlock
from models.numerics import at_least_float32


@dataclass
class Qwen3Shape:
    """What Qwen3's attention, norms, embeddings and RoPE read; the dense and MoE variants add
    their feed-forward."""

    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_embeddings: bool = True
    max_seq_len: int = 4096

    def shape_problems(self) -> list[str]:
        """Shapes the layers cannot be built with (a variant adds its own)."""
        problems = []
        if self.head_dim % 2:
            problems.append(f"head_dim = {self.head_dim} is odd (RoPE rotates pairs)")
        if self.n_heads % self.n_kv_heads:
            problems.append(
                f"n_heads = {self.n_heads} is not a multiple of n_kv_heads = {self.n_kv_heads}"
            )
        return problems

    def __post_init__(self) -> None:
        problems = self.shape_problems()
        if problems:
            raise ValueError("model shape: " + "; ".join(problems) + ".")


@dataclass
class Qwen3Args(Qwen3Shape):
    ffn_dim: int = 3072  # the SwiGLU hidden size


def rope_table(
    args: Qwen3Args, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[max_seq_len, head_dim // 2, 2] table of (cos, sin) per position and frequency, in
    `dtype` (float32; float64 for a float64 model)."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    t = torch.arange(args.max_seq_len, dtype=torch.float64)
    angles = torch.outer(t, inv_freq).to(device=device, dtype=dtype)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotates (x[i], x[i + head_dim/2]) pairs: x [batch, seq, heads, head_dim]; table as
    Llama's `apply_rope`: [>= seq, head_dim // 2, 2] or one row per token [batch, seq, ...]."""
    table = table[: x.shape[1]] if table.dim() == 3 else table
    cos, sin = table[..., None, :, 0], table[..., None, :, 1]
    a, b = at_least_float32(x).chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).type_as(x)


class Attention(GroupedQueryAttention):
    """Grouped-query causal attention with RMSNorm on each query and key head (QK-norm)
    before the rotate-half RoPE."""

    def __init__(self, args: Qwen3Args):
        super().__init__(
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            apply_rope,
            qk_norm_eps=args.norm_eps,
        )


class Block(PreNormBlock):
    def __init__(self, args: Qwen3Args):
        super().__init__(
            Attention(args), FeedForward(args.dim, args.ffn_dim), args.dim, args.norm_eps
        )


class Qwen3(Decoder):
    block_cls = Block  # a variant family (Qwen3-MoE) swaps the block
    rope_table = staticmethod(rope_table)

    def __init__(self, args: Qwen3Args):
        super().__init__(args, [self.block_cls(args) for _ in range(args.n_layers)])

    def init_param(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Unit norm weights; every matrix (embeddings included, which the output may share)
        a normal of std 0.02 cut at 3 std, as the Hugging Face initialisation."""
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith(".weight"):
            nn.init.trunc_normal_(tensor, std=0.02, a=-0.06, b=0.06, generator=generator)
        else:
            raise ValueError(f"init_param: no initialisation rule for parameter '{name}'")
