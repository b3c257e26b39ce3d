"""What the families with an explicit head dimension share (Qwen3, Qwen3-MoE, Gemma 2,
Gemma 3): the decoder shape their attention, norms, embeddings and RoPE read, its rotate-half
RoPE table (models/rope.py: the first and second halves of a head are the pairs, as in the
Hugging Face checkpoints), the grouped-query attention with per-head QK-norm, and the decoder built from
such a shape with the Hugging Face initialisation. Plain PyTorch; a family adds its
feed-forward, its block and its own fields."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.blocks import Decoder, GroupedQueryAttention
from models.rope import apply_rotate_half, cos_sin_table, inverse_frequencies


@dataclass
class DecoderShape:
    """The attention, norm, embedding and RoPE shape of a decoder whose head dimension is set
    on its own (not dim / n_heads); a family adds its feed-forward and its own fields."""

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
        """Shapes the layers cannot be built with (a family adds its own)."""
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


def rope_table(
    args: DecoderShape, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[max_seq_len, head_dim // 2, 2] (cos, sin) table for the rotate-half RoPE, the angles in
    float64, kept in `dtype` (float32; float64 for a float64 model)."""
    inv_freq = inverse_frequencies(args.head_dim, args.rope_theta)
    return cos_sin_table(inv_freq, args.max_seq_len, device, dtype)


class QKNormAttention(GroupedQueryAttention):
    """Grouped-query causal attention with RMSNorm on each query and key head (QK-norm)
    before the rotate-half RoPE."""

    def __init__(self, args: DecoderShape):
        super().__init__(
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            apply_rotate_half,
            qk_norm_eps=args.norm_eps,
        )


class ShapedDecoder(Decoder):
    """The shared decoder shell over `args.n_layers` blocks of `block_cls`, with the
    rotate-half RoPE table and the Hugging Face initialisation."""

    block_cls: type[nn.Module]
    rope_table = staticmethod(rope_table)

    def __init__(self, args: DecoderShape):
        super().__init__(args, self.build_blocks(args))

    @classmethod
    def build_blocks(cls, args: DecoderShape) -> list[nn.Module]:
        """The blocks, `block_cls(args)` each (a family whose layers differ builds its own)."""
        return [cls.block_cls(args) for _ in range(args.n_layers)]

    def init_param(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Unit norm weights; every matrix (embeddings included, which the output may share)
        a normal of std 0.02 cut at 3 std, as the Hugging Face initialisation."""
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith(".weight"):
            nn.init.trunc_normal_(tensor, std=0.02, a=-0.06, b=0.06, generator=generator)
        else:
            raise ValueError(f"init_param: no initialisation rule for parameter '{name}'")
