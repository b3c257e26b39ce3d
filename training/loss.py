"""Token-level cross-entropy in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of per-token losses, computed in float32.

    Summing lets the step divide by the token count of the whole optimizer step, so every
    token weighs the same whatever the micro-batching and data-parallel degree.
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
    # Under tensor parallelism's `loss_parallel()` the logits are vocabulary-sharded DTensors
    # and the loss a replicated DTensor: hand back a plain tensor (still differentiable).
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
