"""Qwen3-MoE in plain PyTorch: no parallelism, no trainer imports.

Attention is Qwen3's (QK-norm, explicit head_dim, rotate-half RoPE: models/decoder_shape.py);
every block's feed-forward is the shared mixture of experts (models/moe.py): a linear router
over E SwiGLU experts, token-choice top-k on the softmax scores, the k weights renormalised to
sum to one (`norm_topk_prob`, as the published Qwen3-MoE models), dropless, with the optional
load balancing that module describes (auxiliary loss, aux-loss-free bias, router z-loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.blocks import PreNormBlock
from models.decoder_shape import DecoderShape, QKNormAttention, ShapedDecoder
from models.moe import MoE, MoEDecoder, MoEShape


@dataclass
class Qwen3MoEArgs(MoEShape, DecoderShape):
    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    tie_embeddings: bool = False


class Block(PreNormBlock):
    mlp_name = "moe"

    def __init__(self, args: Qwen3MoEArgs):
        super().__init__(QKNormAttention(args), MoE(args), args.dim, args.norm_eps)


class Qwen3MoE(MoEDecoder, ShapedDecoder):
    """Qwen3's decoder with an MoE block: embeddings, norms, output, RoPE, tying and
    initialisation as Qwen3's (the shared `ShapedDecoder`)."""

    block_cls = Block

    def init_param(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Qwen3's rules (unit norms, std-0.02 matrices, router included); the experts' [E, out,
        in] tensors like every matrix (Hugging Face's initialisation)."""
        if name.endswith((".w1", ".w2", ".w3")):
            nn.init.trunc_normal_(tensor, std=0.02, a=-0.06, b=0.06, generator=generator)
        else:
            super().init_param(name, tensor, generator)
