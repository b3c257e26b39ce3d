"""DeepSeek-V3 in plain PyTorch: no parallelism, no trainer imports. Hugging Face's
`DeepseekV3ForCausalLM` is the reference; what differs from the other MoE families:
- multi-head latent attention (MLA): queries through a low-rank bottleneck (`wq_a`, an RMSNorm,
  `wq_b`; or one `wq` without `q_lora_rank`), keys and values from one compressed latent per
  token (`wkv_a` gives the latent and a single RoPE key shared by every head, `kv_norm`, then
  `wkv_b` expands the latent into each head's key part and value). Each head's query and key are
  a part without position (`qk_nope_head_dim`) and a rotated part (`qk_rope_head_dim`,
  interleaved pairs); its value has a head size of its own (`v_head_dim`). The shared core
  computes softmax(scale q k^T) v (models/attention.py), so CP and the block masks apply;
- YaRN RoPE on the rotated parts with DeepSeek's mscale rule: cos and sin scaled by
  mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1 for the published configs) and
  the softmax scale by mscale(factor, mscale_all_dim)^2;
- the first `n_dense_layers` blocks with a dense SwiGLU, the others with the shared MoE layer in
  DeepSeek's routing (models/moe.py: sigmoid scores, group-limited choice, scaled weights, the
  aux-loss-free bias, shared experts);
- untied output; RMSNorm eps 1e-6;
- multi-token prediction (`mtp_depth` modules, models/mtp.py, each with an MoE block; the
  published checkpoint's layer 61): off in the flavors, whose parameter counts are the published
  main model's, and on (depth 1, weight 0.3 as DeepSeek-V3's first 10T tokens) in the preset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from models.attention import AttentionBatch, AttentionCore, AttentionSpec
from models.blocks import FeedForward, PreNormBlock
from models.decoder_shape import DecoderShape, ShapedDecoder
from models.moe import MoE, MoEDecoder, MoEShape
from models.mtp import MultiTokenPrediction
from models.rope import apply_interleaved, cos_sin_table, yarn_scaled


@dataclass
class DeepSeekV3Args(MoEShape, DecoderShape):
    """The shared decoder and MoE shapes with the published 671B's values, and DeepSeek-V3's own
    fields. `head_dim` is the query and key head size (qk_nope_head_dim + qk_rope_head_dim,
    what the framework's attention FLOPs read); `n_kv_heads` equals `n_heads` (every head has
    its own key and value, expanded from the shared latent)."""

    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    n_kv_heads: int = 128
    head_dim: int = 192
    vocab_size: int = 129280
    norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    tie_embeddings: bool = False
    max_seq_len: int = 163840
    q_lora_rank: int = 1536  # 0: one query projection, no bottleneck
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    ffn_dim: int = 18432  # the dense blocks' SwiGLU
    n_dense_layers: int = 3
    n_experts: int = 256
    top_k: int = 8
    moe_ffn_dim: int = 2048
    n_shared_experts: int = 1
    moe_score_func: str = "sigmoid"
    moe_n_groups: int = 8
    moe_topk_groups: int = 4
    moe_route_scale: float = 2.5
    moe_aux_loss_coeff: float = 0.0
    moe_bias_update_rate: float = 1e-3
    rope_factor: float = 40.0  # YaRN: frequency division and the old context
    rope_old_context: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0
    mtp_depth: int = 0  # multi-token-prediction modules (models/mtp.py); 0 = off
    mtp_loss_weight: float = 0.3  # lambda: their mean loss's weight in training

    def shape_problems(self) -> list[str]:
        problems = super().shape_problems()
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            problems.append(f"head_dim = {self.head_dim} must be qk_nope_head_dim + "
                            f"qk_rope_head_dim = {self.qk_nope_head_dim + self.qk_rope_head_dim}")  # fmt: skip
        if self.n_kv_heads != self.n_heads:
            problems.append(f"n_kv_heads = {self.n_kv_heads} must equal n_heads (MLA)")
        if self.qk_rope_head_dim % 2 or not 0 <= self.n_dense_layers <= self.n_layers:
            problems.append("qk_rope_head_dim even and n_dense_layers in 0..n_layers")
        if self.mtp_depth < 0 or self.mtp_loss_weight < 0:
            problems.append("mtp_depth and mtp_loss_weight at least 0")
        return problems


def _mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude rule, 0.1 mscale ln(factor) + 1 (1 without scaling)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def softmax_scale(args: DeepSeekV3Args) -> float:
    """1 / sqrt(head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN."""
    return args.head_dim**-0.5 * _mscale(args.rope_factor, args.rope_mscale_all_dim) ** 2


def rope_table(
    args: DeepSeekV3Args, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[max_seq_len, qk_rope_head_dim // 2, 2] (cos, sin) of the YaRN frequencies of the
    rotated parts, scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    inv_freq, _ = yarn_scaled(
        args.qk_rope_head_dim, args.rope_theta, args.rope_factor, args.rope_old_context,
        args.rope_beta_fast, args.rope_beta_slow, truncate=True,
    )  # fmt: skip
    scale = _mscale(args.rope_factor, args.rope_mscale) / _mscale(
        args.rope_factor, args.rope_mscale_all_dim
    )
    table = cos_sin_table(inv_freq, args.max_seq_len, device, torch.float64)
    return (table * scale).to(dtype)


class LatentAttention(nn.Module):
    """Multi-head latent attention (the module doc), over the shared attention core."""

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        h, self.nope, self.rope_dim = args.n_heads, args.qk_nope_head_dim, args.qk_rope_head_dim
        self.head_dim, self.v_dim, self.latent = args.head_dim, args.v_head_dim, args.kv_lora_rank
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, h * args.head_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, h * args.head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, h * (args.qk_nope_head_dim + args.v_head_dim),
                               bias=False)  # fmt: skip
        self.wo = nn.Linear(h * args.v_head_dim, args.dim, bias=False)
        self.core = AttentionCore(AttentionSpec(scale=softmax_scale(args)))

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, batch: AttentionBatch | None = None
    ) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q_nope, q_rot = q.view(bs, seq, -1, self.head_dim).split([self.nope, self.rope_dim], -1)
        latent, k_rot = self.wkv_a(x).split([self.latent, self.rope_dim], -1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bs, seq, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        k_rot = apply_interleaved(k_rot.unsqueeze(2), rope)  # one rotated key for every head
        q = torch.cat([q_nope, apply_interleaved(q_rot, rope)], -1)
        k = torch.cat([k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)], -1)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), batch)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class DenseBlock(PreNormBlock):
    """Pre-norm block: latent attention, the dense SwiGLU (the first `n_dense_layers`)."""

    def __init__(self, args: DeepSeekV3Args):
        mlp = FeedForward(args.dim, args.ffn_dim)
        super().__init__(LatentAttention(args), mlp, args.dim, args.norm_eps)


class MoEBlock(PreNormBlock):
    """Pre-norm block: latent attention, the MoE layer with DeepSeek's routing."""

    mlp_name = "moe"

    def __init__(self, args: DeepSeekV3Args):
        super().__init__(LatentAttention(args), MoE(args), args.dim, args.norm_eps)


class DeepSeekV3(MoEDecoder, ShapedDecoder):
    """The shared decoder shell over DeepSeek-V3's dense then MoE blocks, with its RoPE table."""

    rope_table = staticmethod(rope_table)

    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args)
        if args.mtp_depth:  # each module's block is an MoE block, as layer n_layers would be
            self.mtp = nn.ModuleDict({str(k): MultiTokenPrediction(args.dim, args.norm_eps,
                                                                   MoEBlock(args))
                                      for k in range(args.mtp_depth)})  # fmt: skip

    @classmethod
    def build_blocks(cls, args: DeepSeekV3Args) -> list[nn.Module]:
        return [DenseBlock(args) if i < args.n_dense_layers else MoEBlock(args)
                for i in range(args.n_layers)]  # fmt: skip

    def init_param(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Hugging Face's rules: unit norms, every matrix (the experts' [E, out, in] ones too) a
        normal of std 0.02, cut at 3 std as the shared decoder's."""
        if name.endswith((".w1", ".w2", ".w3")):
            nn.init.trunc_normal_(tensor, std=0.02, a=-0.06, b=0.06, generator=generator)
        else:
            super().init_param(name, tensor, generator)
