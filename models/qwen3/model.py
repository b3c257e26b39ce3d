"""Qwen3 (dense) in plain PyTorch: no parallelism, no trainer imports.

What differs from Llama 3: RMSNorm over each head's query and key (QK-norm) before RoPE, a
head dimension set on its own (not dim / n_heads), RoPE in the rotate-half convention
(the first and second halves of a head are the pairs, as in the Hugging Face checkpoints),
theta 1e6, and optionally the output projection tied to the token embeddings.

The same layout rules as every family: blocks in a ModuleDict keyed by layer index, and
`tok_embeddings` / `norm` / `output` set to None on pipeline stages that lack them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import ScaledDotProductAttention
from models.numerics import at_least_float32, at_least_float32_dtype


@dataclass
class Qwen3Args:
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128
    ffn_dim: int = 3072
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_embeddings: bool = True
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        problems = []
        if self.head_dim % 2:
            problems.append(f"head_dim = {self.head_dim} is odd (RoPE rotates pairs)")
        if self.n_heads % self.n_kv_heads:
            problems.append(
                f"n_heads = {self.n_heads} is not a multiple of n_kv_heads = {self.n_kv_heads}"
            )
        if problems:
            raise ValueError("model shape: " + "; ".join(problems) + ".")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads


def rope_table(
    args: Qwen3Args, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[max_seq_len, head_dim // 2, 2] table of (cos, sin) per position and frequency, in
    `dtype` (float32; float64 for a float64 model)."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    t = torch.arange(args.max_seq_len, dtype=torch.float64)
    angles = torch.outer(t, inv_freq).to(device=device, dtype=dtype)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotates (x[i], x[i + head_dim/2]) pairs: x [batch, seq, heads, head_dim]; table as
    Llama's `apply_rope`: [>= seq, head_dim // 2, 2] or one row per token [batch, seq, ...]."""
    table = table[: x.shape[1]] if table.dim() == 3 else table
    cos, sin = table[..., None, :, 0], table[..., None, :, 1]
    a, b = at_least_float32(x).chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    """Grouped-query causal attention with RMSNorm on each query and key head."""

    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.core = ScaledDotProductAttention()  # causal / masked SDPA over the heads
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.q_norm(self.wq(x).view(bs, seq, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bs, seq, -1, self.head_dim))
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x) (Hugging Face: down(silu(gate x) * up x))."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Qwen3(nn.Module):
    block_cls = Block  # a variant family (Qwen3-MoE) swaps the block

    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.block_cls(args) for i in range(args.n_layers)})
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
        """The RoPE table in the dtype the model was built or cast in (at least float32)."""
        dtype = at_least_float32_dtype(self.rope.dtype)
        self.rope = rope_table(self.args, torch.device(device), dtype)

    def init_param(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Unit norm weights; every matrix (embeddings included, which the output may share)
        a normal of std 0.02 cut at 3 std, as the Hugging Face initialisation."""
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith(".weight"):
            nn.init.trunc_normal_(tensor, std=0.02, a=-0.06, b=0.06, generator=generator)
        else:
            raise ValueError(f"init_param: no initialisation rule for parameter '{name}'")
