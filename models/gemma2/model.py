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

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionBatch, AttentionSpec
from models.blocks import Decoder, FeedForward, GroupedQueryAttention
from models.decoder_shape import DecoderShape, apply_rope, rope_table
from models.numerics import at_least_float32


@dataclass
class Gemma2Args(DecoderShape):
    """The shared decoder shape's fields (and shape checks), with Gemma 2's defaults, plus its
    own: the GeGLU width, the softmax scale, the soft-caps and the sliding window."""

    dim: int = 2304
    n_layers: int = 26
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 256
    vocab_size: int = 256000
    rope_theta: float = 10000.0
    max_seq_len: int = 8192
    ffn_dim: int = 9216  # the GeGLU hidden size
    query_pre_attn_scalar: float = 256  # softmax scale = query_pre_attn_scalar ** -0.5
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


class RMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in at least float32 and cast back to x's dtype afterwards
    (HF multiplies before the cast, unlike Llama's); the weight starts at 0."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = at_least_float32(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(h.dtype))).type_as(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


@functools.cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (a Python float, so that it multiplies DTensors too)."""
    return torch.tensor(value, dtype=dtype).item()


class ScaledEmbedding(nn.Embedding):
    """Embeddings times sqrt(dim), the factor rounded to their dtype (bf16: 48.0 for 2304)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = super().forward(tokens)
        return h * _in_dtype(math.sqrt(self.embedding_dim), h.dtype)


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


class GeGLU(FeedForward):
    """w2(gelu_tanh(w1 x) * w3 x) (Hugging Face: down(gelu_tanh(gate x) * up x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))


class Block(nn.Module):
    """h = x + post_attention_norm(attention(attention_norm(x)));
    out = h + post_ffn_norm(feed_forward(ffn_norm(h)))."""

    def __init__(self, args: Gemma2Args, layer: int):
        super().__init__()
        self.attention = GroupedQueryAttention(
            args.dim, args.n_heads, args.n_kv_heads, args.head_dim, apply_rope,
            spec=args.attention_spec(layer),
        )  # fmt: skip
        self.feed_forward = GeGLU(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.post_ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, batch: AttentionBatch | None = None
    ) -> torch.Tensor:
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x), rope, batch))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class Gemma2(Decoder):
    rope_table = staticmethod(rope_table)

    def __init__(self, args: Gemma2Args):
        super().__init__(args, [Block(args, i) for i in range(args.n_layers)])
        # the shell's modules, replaced by Gemma's (same names and shapes)
        self.tok_embeddings = ScaledEmbedding(args.vocab_size, args.dim)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = SoftcappedLinear(args.dim, args.vocab_size, args.final_softcap)
        self.tie_weights()

    def init_param(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Norm weights 0 (they scale by 1 + weight); every matrix (embeddings included, which
        the output shares) a normal of std 0.02 cut at 3 std."""
        if name.endswith("norm.weight"):
            tensor.zero_()
        elif name.endswith(".weight"):
            nn.init.trunc_normal_(tensor, std=0.02, a=-0.06, b=0.06, generator=generator)
        else:
            raise ValueError(f"init_param: no initialisation rule for parameter '{name}'")
