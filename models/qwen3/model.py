"""Qwen3 (dense) in plain PyTorch: no parallelism, no trainer imports.

What differs from Llama 3: RMSNorm over each head's query and key (QK-norm) before RoPE, a
head dimension set on its own (not dim / n_heads), RoPE in the rotate-half convention
(the first and second halves of a head are the pairs, as in the Hugging Face checkpoints),
theta 1e6, and optionally the output projection tied to the token embeddings.

The decoder shell, SwiGLU and block are the shared ones (models/blocks.py); the shape, the
QK-norm attention, the rotate-half RoPE and the initialisation are shared with the families of
the same shape (models/decoder_shape.py): blocks in a ModuleDict keyed by layer index, and
`tok_embeddings` / `norm` / `output` set to None on pipeline stages that lack them.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.blocks import FeedForward, PreNormBlock
from models.decoder_shape import DecoderShape, QKNormAttention, ShapedDecoder


@dataclass
class Qwen3Args(DecoderShape):
    ffn_dim: int = 3072  # the SwiGLU hidden size


class Block(PreNormBlock):
    def __init__(self, args: Qwen3Args):
        super().__init__(
            QKNormAttention(args), FeedForward(args.dim, args.ffn_dim), args.dim, args.norm_eps
        )


class Qwen3(ShapedDecoder):
    """The shared decoder of QK-norm blocks with SwiGLU feed-forwards (a variant family, such
    as Qwen3-MoE, builds its own block on the same shape)."""

    block_cls = Block
