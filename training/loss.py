"""Token-level cross-entropy in float32 (float64 for float64 logits)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from models.numerics import at_least_float32


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of per-token losses, computed in float32 (float64 logits stay float64:
    the exact-arithmetic parity mode).

    Summing lets the step divide by the token count of the whole optimizer step, so every
    token weighs the same whatever the micro-batching and data-parallel degree.
    """
    logits = at_least_float32(logits.flatten(0, 1))
    loss = F.cross_entropy(logits, labels.flatten(0, 1), reduction="sum")
    # Under tensor parallelism's `loss_parallel()` the logits are vocabulary-sharded DTensors
    # and the loss a replicated DTensor: hand back a plain tensor (still differentiable).
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
