"""gpt-oss in plain PyTorch: no parallelism, no trainer imports. Hugging Face's
`GptOssForCausalLM` is the reference; what differs from Qwen3-MoE:
- attention with biases on the four projections and no QK-norm, every layer with a learned
  sink logit per head (`AttentionSpec(sinks=True)`: the shared core owns it, so TP shards it
  with the heads and CP computes it over the whole sequence), the even layers (0, 2, ...)
  over a sliding window of 128 positions, the odd ones over the whole causal past;
- rotate-half RoPE with YaRN scaling (models/rope.py: factor 32 over a 4,096-token original
  context, cos and sin scaled by the attention factor);
- the shared MoE layer (models/moe.py) with a router bias, top-4: the softmax over the 4
  largest logits, which is the renormalised top-4 of the softmax (`norm_topk_prob`);
- experts with biases and the clamped SwiGLU: gate and up interleaved in one projection
  (`gate_up_proj` [E, dim, 2F], the published layout), gate clamped above at `swiglu_limit`,
  up clamped to +-limit, out = (up + 1) * gate * sigmoid(`swiglu_alpha` * gate);
- untied output; RMSNorm eps 1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.attention import AttentionSpec
from models.blocks import GroupedQueryAttention, PreNormBlock
from models.decoder_shape import DecoderShape, ShapedDecoder
from models.moe import MoE, MoEDecoder, MoEShape, grouped_matmul
from models.rope import apply_rotate_half, cos_sin_table, yarn_scaled


@dataclass
class GptOssArgs(MoEShape, DecoderShape):
    """The shared decoder and MoE shapes with the published 20B's defaults, and gpt-oss's
    own fields."""

    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201088
    norm_eps: float = 1e-5
    rope_theta: float = 150_000.0
    tie_embeddings: bool = False
    max_seq_len: int = 131072
    n_experts: int = 32
    top_k: int = 4
    moe_ffn_dim: int = 2880
    sliding_window: int = 128  # the even layers' window; the odd layers see the whole past
    rope_factor: float = 32.0  # YaRN: frequency division and the old context
    rope_old_context: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def shape_problems(self) -> list[str]:
        problems = super().shape_problems()
        if self.sliding_window < 1 or self.swiglu_limit <= 0 or self.rope_factor < 1:
            problems.append("sliding_window >= 1, swiglu_limit > 0 and rope_factor >= 1")
        return problems


def rope_table(
    args: GptOssArgs, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[max_seq_len, head_dim // 2, 2] rotate-half (cos, sin) table of the YaRN frequencies,
    both scaled by YaRN's attention factor; angles in float64, kept in `dtype`."""
    inv_freq, attention_factor = yarn_scaled(
        args.head_dim, args.rope_theta, args.rope_factor, args.rope_old_context,
        args.rope_beta_fast, args.rope_beta_slow, args.rope_truncate,
    )  # fmt: skip
    table = cos_sin_table(inv_freq, args.max_seq_len, device, torch.float64)
    return (table * attention_factor).to(dtype)


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on the fused projection's output (gate and up
    interleaved): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate,
    limit)."""
    gate, up = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


class ClampedSwiGLUExperts(nn.Module):
    """E experts with biases, in the published layout: `gate_up_proj` [E, dim, 2F] (gate and up
    columns interleaved) and its bias [E, 2F], `down_proj` [E, F, dim] and its bias [E, dim]."""

    def __init__(self, args: GptOssArgs):
        super().__init__()
        n, dim, hidden = args.n_experts, args.dim, args.moe_ffn_dim
        self.alpha, self.limit, self.grouped = (
            args.swiglu_alpha,
            args.swiglu_limit,
            args.moe_grouped_mm,
        )
        self.gate_up_proj = nn.Parameter(torch.empty(n, dim, 2 * hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n, 2 * hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(n, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, weights=None) -> torch.Tensor:
        """x [N, dim], rows sorted by expert with `counts` rows each -> [N, dim]. `weights`:
        the four tensors of the experts `counts` covers, when a parallelism holds only some."""
        gate_up, gate_up_bias, down, down_bias = weights if weights is not None else (
            self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias
        )  # fmt: skip
        if not self.grouped:  # one matmul per expert: the reference
            out, start = [], 0
            for e, n in enumerate(counts.tolist()):
                rows = x[start : start + n]
                h = clamped_swiglu(rows @ gate_up[e] + gate_up_bias[e], self.alpha, self.limit)
                out.append(h @ down[e] + down_bias[e])
                start += n
            return torch.cat(out) if out else x.new_zeros(0, down.shape[-1])
        expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts)
        h = grouped_matmul(x, gate_up, counts)
        h = clamped_swiglu(h + gate_up_bias[expert].to(h.dtype), self.alpha, self.limit)
        out = grouped_matmul(h, down, counts)
        return out + down_bias[expert].to(out.dtype)


class Block(PreNormBlock):
    """Pre-norm block: the layer's attention (window on even layers, sinks on all), the MoE."""

    mlp_name = "moe"

    def __init__(self, args: GptOssArgs, layer: int):
        window = args.sliding_window if layer % 2 == 0 else None
        attention = GroupedQueryAttention(
            args.dim, args.n_heads, args.n_kv_heads, args.head_dim, apply_rotate_half,
            spec=AttentionSpec(window=window, sinks=True), bias=True,
        )  # fmt: skip
        moe = MoE(args, ClampedSwiGLUExperts(args), router_bias=True)
        super().__init__(attention, moe, args.dim, args.norm_eps)


class GptOss(MoEDecoder, ShapedDecoder):
    """The shared decoder shell over gpt-oss blocks, with the YaRN RoPE table."""

    rope_table = staticmethod(rope_table)

    @classmethod
    def build_blocks(cls, args: GptOssArgs) -> list[nn.Module]:
        return [Block(args, i) for i in range(args.n_layers)]

    def init_param(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Hugging Face's gpt-oss rules: the sinks, the router bias and the experts' matrices a
        normal of std 0.02 (cut at 3 std, as every matrix here), the other biases zero; the
        rest as the shared decoder (unit norms, std-0.02 matrices)."""
        if name.endswith(("core.sinks", "router.bias", "gate_up_proj", "down_proj")):
            nn.init.trunc_normal_(tensor, std=0.02, a=-0.06, b=0.06, generator=generator)
        elif name.endswith("bias"):
            tensor.zero_()
        else:
            super().init_param(name, tensor, generator)
