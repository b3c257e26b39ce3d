"""Llama 3 in plain PyTorch: no parallelism, no trainer imports; fork this file freely.

Layers live in a ModuleDict keyed by layer index, so a pipeline stage is this model with other
layers deleted (and `tok_embeddings`/`norm`/`output` set to None) while checkpoint keys stay
stable. Weights are created on any device (meta included); `init_param` says how each one is
initialised and `init_buffers` fills the RoPE table, so the trainer can materialise and
initialise the weights the same way under every layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import ScaledDotProductAttention
from models.numerics import at_least_float32, at_least_float32_dtype


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: one key/value head per query head (no grouping)
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = False  # Llama 3.1 long-context frequency scaling
    rope_scaling_factor: float = 8.0  # how much it stretches the low frequencies (3.2: 32)
    tie_embeddings: bool = False  # output projection = token embeddings (Llama 3.2 1B/3B)
    max_seq_len: int = 8192
    depth_init: bool = True  # output-projection std shrinks with depth

    def __post_init__(self) -> None:
        """Shapes the layers cannot be built with fail here, not inside attention."""
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        problems = []
        if self.dim % self.n_heads:
            problems.append(f"dim = {self.dim} is not a multiple of n_heads = {self.n_heads}")
        elif self.head_dim % 2:
            problems.append(
                f"head_dim = dim / n_heads = {self.head_dim} is odd (RoPE rotates pairs)"
            )
        if self.n_heads % self.n_kv_heads:
            problems.append(
                f"n_heads = {self.n_heads} is not a multiple of n_kv_heads = {self.n_kv_heads} "
                "(each key/value head serves n_heads / n_kv_heads query heads)"
            )
        if problems:
            raise ValueError("model shape: " + "; ".join(problems) + ".")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, times the multiplier, rounded up to multiple_of."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def rope_frequencies(args: ModelArgs, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), with Llama 3.1 scaling of the low frequencies
    (computed in float64, returned in `dtype`)."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if args.use_scaled_rope:
        scale, low_ff, high_ff, old_ctx = args.rope_scaling_factor, 1.0, 4.0, 8192
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_ctx / low_ff, old_ctx / high_ff
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scale, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / scale + smooth * inv_freq, scaled)
    return inv_freq.to(dtype)


def rope_table(
    args: ModelArgs, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[max_seq_len, head_dim // 2, 2] table of (cos, sin) per position and frequency, in
    `dtype` (float32; float64 for a float64 model)."""
    inv_freq = rope_frequencies(args, dtype).to(device)
    t = torch.arange(args.max_seq_len, device=device, dtype=dtype)
    angles = torch.outer(t, inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotates adjacent pairs (x[2i], x[2i+1]) of each head (Meta's interleaved convention).

    x: [batch, seq, heads, head_dim]; table: [>= seq, head_dim // 2, 2] (positions 0, 1, ...)
    or [batch, seq, head_dim // 2, 2] (each token's own row).
    """
    table = table[: x.shape[1]] if table.dim() == 3 else table
    pairs = at_least_float32(x).unflatten(-1, (-1, 2))
    cos = table[..., None, :, 0]
    sin = table[..., None, :, 1]
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query causal self-attention through scaled_dot_product_attention."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.core = ScaledDotProductAttention()  # causal / masked SDPA over the heads

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(args), persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With `tie_embeddings` the output projection is the token embedding matrix."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab] (a pipeline stage may take and
        return hidden states [batch, seq, dim] instead). `positions` [batch, seq]: each token's
        position in its sequence, for RoPE (default 0..seq-1; a context-parallel rank holds
        other positions); `attention_mask`: see models/attention.py (default causal)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope, attention_mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_buffers(self, device: torch.device | str) -> None:
        """Fills the non-persistent RoPE table (after `to_empty` from the meta device), in the
        dtype the model was built or cast in (at least float32)."""
        dtype = at_least_float32_dtype(self.rope.dtype)
        self.rope = rope_table(self.args, torch.device(device), dtype)

    def init_param(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Initialises the full (unsharded) value of parameter `name` in place.

        Truncated normals (cut at 3 std) of std 0.02 for the input projections, a depth-scaled
        std for the projections that write into the residual stream (wo, w2, w3, as in Llama
        practice), dim^-0.5 for the output layer, N(0, 1) embeddings (N(0, 0.02²) when they
        are also the output projection) and unit norm weights.
        """
        a = self.args
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
            return
        if name == "tok_embeddings.weight":  # tied, it is also the output projection
            std = 0.02 if a.tie_embeddings else 1.0
            nn.init.normal_(tensor, std=std, generator=generator)
            return
        if name == "output.weight":
            std = a.dim**-0.5
        elif name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight")):
            std = 0.02
        elif name.endswith(("wo.weight", "w2.weight", "w3.weight")):
            layer_id = int(name.split(".")[1])
            std = 0.02 / math.sqrt(2 * (layer_id + 1) if a.depth_init else 2 * a.n_layers)
        else:
            raise ValueError(f"init_param: no initialisation rule for parameter '{name}'")
        nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
