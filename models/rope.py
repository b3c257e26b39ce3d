"""Rotary position embeddings, both conventions and their frequency rules, for every family
(plain PyTorch, no parallelism).

A table is [positions, head_dim // 2, 2]: (cos, sin) per position and frequency. Two ways to
pair a head's elements, one per checkpoint lineage:
- interleaved (Meta's Llama): (x[2i], x[2i + 1]) rotate together (`apply_interleaved`);
- rotate-half (Hugging Face's Qwen3, Gemma): (x[i], x[i + head_dim / 2]) (`apply_rotate_half`).
Frequencies theta^(-2i/d) are computed in float64; Llama 3.1 stretches the low ones
(`llama3_scaled`), Gemma 3's global layers divide them all (linear scaling), YaRN (gpt-oss)
blends divided and kept frequencies by their rotations over the old context and scales the
table (`yarn_scaled`).
"""

from __future__ import annotations

import math

import torch

from models.numerics import at_least_float32


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2, in float64."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def llama3_scaled(inv_freq: torch.Tensor, factor: float, old_context: int = 8192) -> torch.Tensor:
    """Llama 3.1's long-context rule: wavelengths beyond the old context divided by `factor`,
    those under a quarter of it kept, a smooth blend between (low/high frequency factors 1, 4)."""
    low_ff, high_ff = 1.0, 4.0
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_context / low_ff, old_context / high_ff
    smooth = (old_context / wavelen - low_ff) / (high_ff - low_ff)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def yarn_scaled(
    head_dim: int,
    theta: float,
    factor: float,
    old_context: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, as transformers computes it): of the frequencies theta^(-2i/d),
    those that turn more than `beta_fast` times over the old context are kept, those turning
    fewer than `beta_slow` times are divided by `factor`, a linear ramp over the dimensions
    between (bounds rounded outward with `truncate`); and the attention factor
    0.1 ln(factor) + 1 that scales cos and sin. Returns (frequencies in float64, factor)."""
    inv_freq = inverse_frequencies(head_dim, theta)

    def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times
        turns = old_context / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(len(inv_freq), dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    scaled = inv_freq / factor * (1 - kept) + inv_freq * kept
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return scaled, attention_factor


def cos_sin_table(
    inv_freq: torch.Tensor,
    positions: int,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    angles_in_float64: bool = True,
) -> torch.Tensor:
    """[positions, len(inv_freq), 2] (cos, sin) table in `dtype`. The angles position x
    frequency in float64 (Hugging Face's rotate-half families here), or in `dtype` as Meta's
    Llama reference computes them (`angles_in_float64` False)."""
    work = torch.float64 if angles_in_float64 else dtype
    t = torch.arange(positions, device=device, dtype=work)
    angles = torch.outer(t, inv_freq.to(device=device, dtype=work)).to(dtype)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def _rows(table: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin broadcast over heads: table [>= seq, d/2, 2] (positions 0, 1, ...) or one row
    per token [batch, seq, d/2, 2]."""
    table = table[: x.shape[1]] if table.dim() == 3 else table
    return table[..., None, :, 0], table[..., None, :, 1]


def apply_interleaved(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotates adjacent pairs (x[2i], x[2i+1]) of each head; x [batch, seq, heads, head_dim],
    in at least float32 and cast back."""
    cos, sin = _rows(table, x)
    pairs = at_least_float32(x).unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).type_as(x)


def apply_rotate_half(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotates (x[i], x[i + head_dim/2]) pairs; x [batch, seq, heads, head_dim], in at least
    float32 and cast back."""
    cos, sin = _rows(table, x)
    a, b = at_least_float32(x).chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).type_as(x)
