"""The pieces Gemma 2 and Gemma 3 share (plain PyTorch, no parallelism): the zero-centred
RMSNorm, the GeGLU MLP, the sqrt(dim)-scaled embeddings, the four-norm block, the
initialisation rule and the Hugging Face names of the block's norms and MLP. Each family folder
keeps only what is its own (Gemma 2's soft-caps and alternating window, Gemma 3's two RoPE
tables and QK-norms); the Hugging Face `Gemma2*` and `Gemma3*` classes are the references.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.blocks import FeedForward
from models.decoder_shape import DecoderShape
from models.numerics import at_least_float32

# the MLP's activation as config.json names it: gelu with the tanh approximation
GELU_TANH = "gelu_pytorch_tanh"
# Arguments both generations read that change the function but no parameter's shape, checked
# against a checkpoint's on resume (`ModelSpec.function_args`); each family adds its own.
GEMMA_FUNCTION_ARGS = ("rope_theta", "norm_eps", "query_pre_attn_scalar", "sliding_window")
# Inside block i, the norms after attention and around the MLP, and the MLP:
# layers.{i}.<ours> <-> model.layers.{i}.<HF>. Mind HF's `post_attention_layernorm`: the norm
# after attention here (ours `post_attention_norm`), the pre-MLP norm in Llama and Qwen3.
HF_NORMS_AND_MLP = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}


@dataclass
class GemmaShape(DecoderShape):
    """The shared decoder shape with the two fields both Gemma generations default alike (the
    published 2B, 9B, 1B, 4B and 12B models): head dimension 256, and the softmax scale
    query_pre_attn_scalar ** -0.5 with query_pre_attn_scalar 256. Sizes (dim, layers, heads)
    are each family's `flavors`, not class defaults."""

    head_dim: int = 256
    query_pre_attn_scalar: float = 256


class ZeroCentredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in at least float32 and cast back to x's dtype afterwards
    (Hugging Face multiplies before the cast, unlike Llama's); the weight starts at 0, a unit
    scale, and is stored as Hugging Face stores it (without the 1)."""

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


class GeGLU(FeedForward):
    """The shared feed-forward's weights with a tanh-approximated GELU gate:
    w2(gelu_tanh(w1 x) * w3 x) (Hugging Face: down(gelu_tanh(gate x) * up x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))


@functools.cache
def rounded_sqrt(dim: int, dtype: torch.dtype, via_float32: bool) -> float:
    """sqrt(dim) rounded to `dtype` as Hugging Face rounds it: Gemma 2 casts the Python value
    to the embeddings' dtype, Gemma 3 makes it a float32 tensor first (bfloat16: 48.0 for
    sqrt(2304); 55.5 for sqrt(3072)). A Python float, so it multiplies DTensors too (the
    product is the same under tensor parallelism's sharded lookup)."""
    value = torch.tensor(math.sqrt(dim), dtype=torch.float32 if via_float32 else dtype)
    return value.to(dtype).item()


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times sqrt(dim), the factor rounded as the family's reference rounds
    it (`rounded_sqrt`)."""

    def __init__(self, vocab_size: int, dim: int, via_float32: bool):
        super().__init__(vocab_size, dim)
        self.via_float32 = via_float32

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = super().forward(tokens)
        return h * rounded_sqrt(self.embedding_dim, h.dtype, self.via_float32)


class FourNormBlock(nn.Module):
    """h = x + post_attention_norm(attention(attention_norm(x), ...));
    out = h + post_ffn_norm(feed_forward(ffn_norm(h))), with zero-centred norms and a GeGLU
    MLP. A family's block gives the attention and says which RoPE rows it reads (`rope_of`)."""

    def __init__(self, dim: int, ffn_dim: int, eps: float, attention: nn.Module):
        super().__init__()
        self.attention = attention
        self.feed_forward = GeGLU(dim, ffn_dim)
        self.attention_norm = ZeroCentredRMSNorm(dim, eps)
        self.post_attention_norm = ZeroCentredRMSNorm(dim, eps)
        self.ffn_norm = ZeroCentredRMSNorm(dim, eps)
        self.post_ffn_norm = ZeroCentredRMSNorm(dim, eps)

    def rope_of(self, rope: torch.Tensor) -> torch.Tensor:
        return rope

    def forward(self, x: torch.Tensor, rope: torch.Tensor, batch=None) -> torch.Tensor:
        attended = self.attention(self.attention_norm(x), self.rope_of(rope), batch)
        h = x + self.post_attention_norm(attended)
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


def init_param(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Gemma's rule: norm weights 0 (a unit scale: the norms multiply by 1 + weight); every
    matrix (the embeddings, which the output shares, included) a normal of std 0.02 cut at 3
    std, as the Hugging Face initialisation."""
    if name.endswith("norm.weight"):
        tensor.zero_()
    elif name.endswith(".weight"):
        nn.init.trunc_normal_(tensor, std=0.02, a=-0.06, b=0.06, generator=generator)
    else:
        raise ValueError(f"init_param: no initialisation rule for parameter '{name}'")
