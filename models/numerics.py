"""Precision helpers the families share (plain PyTorch, no parallelism)."""

from __future__ import annotations

import torch


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32 for the numerically sensitive steps (RoPE, the router's softmax, the
    loss), or in its own dtype where that is wider: a float64 run (the exact-arithmetic parity
    mode) must not round to float32 anywhere."""
    return x if x.dtype == torch.float64 else x.float()


def at_least_float32_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype `at_least_float32` gives a tensor of `dtype`."""
    return torch.promote_types(dtype, torch.float32)
