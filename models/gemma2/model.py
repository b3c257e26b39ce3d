"""Gemma 2 in plain PyTorch: no parallelism, no trainer imports.

What differs from Llama 3 / Qwen3 (Hugging Face `Gemma2ForCausalLM` is the reference):
- attention logits soft-capped (`softcap * tanh(logits / softcap)`, 50) and scaled by
  `query_pre_attn_scalar ** -0.5` instead of 1 / sqrt(head_dim);
- a sliding window (4096 tokens) on every other layer: the even-indexed layers (0, 2, ...)
  slide, the odd ones see the whole causal prefix (transformers' default `layer_types`);
- both written as each layer's `AttentionSpec`, computed by the shared `AttentionCore`, so
  context parallelism and document masking need no code here;
- four norms per block, before and after attention and the MLP, each an RMSNorm scaling by
  (1 + weight) (weight initialised to 0), computed in at least float32 and then cast back;
- a GeGLU MLP (gelu with the tanh approximation);
- token embeddings multiplied by sqrt(dim), rounded to the embeddings' dtype first (as HF);
- the output projection tied to the embeddings, its logits soft-capped (30);
- rotate-half RoPE, theta 10000 (the shared table and rotation, models/decoder_shape.py).

The embedding scale and the final soft-cap live in the embedding and output modules, so the
shared decoder shell (models/blocks.py) runs the model unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models import gemma_blocks
from models.attention import AttentionSpec
from models.blocks import Decoder, GroupedQueryAttention
from models.decoder_shape import rope_table
from models.gemma_blocks import FourNormBlock, GemmaShape, ScaledEmbedding, ZeroCentredRMSNorm
from models.rope import apply_rotate_half


@dataclass
class Gemma2Args(GemmaShape):
    """The shared Gemma shape's fields (and shape checks) with Gemma 2's published vocabulary,
    RoPE base and context, plus its own: the GeGLU width, the soft-caps and the sliding window.
    Sizes come from `flavors` (the 2B, 9B, 27B and the debug model)."""

    vocab_size: int = 256000
    rope_theta: float = 10000.0
    max_seq_len: int = 8192
    ffn_dim: int = 9216  # the GeGLU hidden size (the 2B's)
    attn_softcap: float | None = 50.0  # None: no soft-capping
    final_softcap: float | None = 30.0
    sliding_window: int | None = 4096  # on the even-indexed layers; None: every layer global

    def sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends within the sliding window (the even ones)."""
        return self.sliding_window is not None and layer % 2 == 0

    def attention_spec(self, layer: int) -> AttentionSpec:
        return AttentionSpec(
            scale=self.query_pre_attn_scalar**-0.5,
            softcap=self.attn_softcap,
            window=self.sliding_window if self.sliding(layer) else None,
        )


class SoftcappedLinear(nn.Linear):
    """The output projection with its logits soft-capped: cap * tanh(logits / cap)."""

    def __init__(self, dim: int, vocab_size: int, softcap: float | None):
        super().__init__(dim, vocab_size, bias=False)
        self.softcap = softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap


class Block(FourNormBlock):
    """Gemma's four-norm block (models/gemma_blocks.py) around the layer's attention: soft-capped,
    sliding on the even-indexed layers."""

    def __init__(self, args: Gemma2Args, layer: int):
        attention = GroupedQueryAttention(
            args.dim, args.n_heads, args.n_kv_heads, args.head_dim, apply_rotate_half,
            spec=args.attention_spec(layer),
        )  # fmt: skip
        super().__init__(args.dim, args.ffn_dim, args.norm_eps, attention)


class Gemma2(Decoder):
    rope_table = staticmethod(rope_table)

    def __init__(self, args: Gemma2Args):
        super().__init__(args, [Block(args, i) for i in range(args.n_layers)])
        # the shell's modules, replaced by Gemma's (same names and shapes)
        self.tok_embeddings = ScaledEmbedding(args.vocab_size, args.dim, via_float32=False)
        self.norm = ZeroCentredRMSNorm(args.dim, args.norm_eps)
        self.output = SoftcappedLinear(args.dim, args.vocab_size, args.final_softcap)
        self.tie_weights()

    init_param = staticmethod(gemma_blocks.init_param)
