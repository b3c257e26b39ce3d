"""Gemma 3 (text) in plain PyTorch: no parallelism, no trainer imports.

What differs from Qwen3 (the Hugging Face `Gemma3ForCausalLM` is the reference):
- local and global layers: every `sliding_window_pattern`-th layer (the 6th, 12th, ...) attends
  to the whole causal past, the others to the last `sliding_window` positions only; both
  through the shared attention core, as `AttentionSpec(scale=..., window=...)`, so context
  parallelism and document masking need no code here;
- two RoPE tables (rotate-half, as Qwen3's): the local layers' base 10,000, the global layers'
  base 1e6 with linear position scaling (the 4B, 12B and 27B models divide the frequencies by
  8); the shell's one `rope` buffer holds both, stacked, and each block picks its row;
- softmax scale query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5);
- RMSNorm with a zero-centred weight, computed in float32: x / rms(x) * (1 + w), cast back
  (Hugging Face's `Gemma3RMSNorm`); four per block (before and after attention and the MLP),
  one over each query and key head (QK-norm) and the final one;
- a GeGLU MLP (tanh-approximated GELU gate);
- token embeddings multiplied by sqrt(dim), that factor rounded as Hugging Face rounds it
  (a float32 value cast to the embeddings' dtype: 55.5 for sqrt(3072) in bfloat16);
- the output projection tied to the embeddings; no logit soft-capping (the published configs
  set `attn_logit_softcapping` and `final_logit_softcapping` to null).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models import gemma_blocks
from models.attention import AttentionSpec
from models.blocks import Decoder, GroupedQueryAttention
from models.gemma_blocks import FourNormBlock, GemmaShape, ScaledEmbedding, ZeroCentredRMSNorm
from models.rope import apply_rotate_half, inverse_frequencies

LOCAL, GLOBAL = 0, 1  # the rows of the stacked RoPE table


@dataclass
class Gemma3Args(GemmaShape):
    """The shared Gemma shape's fields and checks (`rope_theta` is the global layers' base) with
    Gemma 3's published vocabulary and the 4B/12B/27B's RoPE and window, plus its own fields.
    Sizes come from `flavors` (the 1B, 4B, 12B, 27B and the debug model)."""

    vocab_size: int = 262208
    ffn_dim: int = 15360  # the GeGLU hidden size (the 12B's)
    rope_local_theta: float = 10_000.0  # local (sliding-window) layers
    rope_scaling_factor: float = 8.0  # linear scaling of the global layers' positions
    sliding_window: int = 1024
    sliding_window_pattern: int = 6  # layer i is global when (i + 1) % pattern == 0

    def shape_problems(self) -> list[str]:
        problems = super().shape_problems()
        if self.sliding_window < 1 or self.sliding_window_pattern < 1:
            problems.append("sliding_window and sliding_window_pattern must be at least 1")
        return problems

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_window_pattern == 0


def rope_table(
    args: Gemma3Args, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[2, max_seq_len, head_dim // 2, 2]: (cos, sin) per position and frequency, row LOCAL for
    the sliding-window layers, row GLOBAL (frequencies divided by the linear scaling factor)
    for the global ones; computed in float64, kept in `dtype`."""
    t = torch.arange(args.max_seq_len, dtype=torch.float64)
    rows = []
    for theta, factor in (
        (args.rope_local_theta, 1.0),
        (args.rope_theta, args.rope_scaling_factor),
    ):
        angles = torch.outer(t, inverse_frequencies(args.head_dim, theta) / factor)
        rows.append(torch.stack([angles.cos(), angles.sin()], dim=-1))
    return torch.stack(rows).to(device=device, dtype=dtype)


class Attention(GroupedQueryAttention):
    """The shared grouped-query attention with Gemma's QK-norm and the layer's spec: the
    sliding window on local layers, none on global ones, scale query_pre_attn_scalar ** -0.5."""

    def __init__(self, args: Gemma3Args, global_layer: bool):
        spec = AttentionSpec(
            scale=args.query_pre_attn_scalar**-0.5,
            window=None if global_layer else args.sliding_window,
        )
        super().__init__(
            args.dim, args.n_heads, args.n_kv_heads, args.head_dim, apply_rotate_half,
            qk_norm_eps=args.norm_eps, spec=spec,
        )  # fmt: skip
        self.q_norm = ZeroCentredRMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = ZeroCentredRMSNorm(args.head_dim, eps=args.norm_eps)


class Block(FourNormBlock):
    """Gemma's four-norm block (models/gemma_blocks.py) around the layer's attention, reading
    the RoPE row of the layer's kind."""

    def __init__(self, args: Gemma3Args, layer: int):
        global_layer = args.is_global(layer)
        super().__init__(args.dim, args.ffn_dim, args.norm_eps, Attention(args, global_layer))
        self.rope_row = GLOBAL if global_layer else LOCAL

    def rope_of(self, rope: torch.Tensor) -> torch.Tensor:
        return rope[self.rope_row]


class Gemma3(Decoder):
    """The shared decoder shell with Gemma's scaled embeddings and final norm, and both RoPE
    tables in its `rope` buffer ([2, positions, ...]: `rope_rows` indexes the positions of
    both)."""

    rope_table = staticmethod(rope_table)

    def __init__(self, args: Gemma3Args):
        super().__init__(args, [Block(args, i) for i in range(args.n_layers)])
        self.tok_embeddings = ScaledEmbedding(args.vocab_size, args.dim, via_float32=True)
        self.norm = ZeroCentredRMSNorm(args.dim, eps=args.norm_eps)
        self.tie_weights()

    def rope_rows(self, positions: torch.Tensor | None) -> torch.Tensor:
        """Both tables' rows: [2, positions, ...], or [2, batch, seq, ...] for given positions."""
        return self.rope if positions is None else self.rope[:, positions]

    init_param = staticmethod(gemma_blocks.init_param)
