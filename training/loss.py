"""Token-level cross-entropy in float32 (float64 for float64 logits), and the loss a training
step backpropagates: the token-loss sum over the step's global count of labelled tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from models.numerics import at_least_float32

IGNORE_INDEX = -100  # a label that counts neither in the loss nor in the token count


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of per-token losses over the labels that are not `IGNORE_INDEX`,
    computed in float32 (float64 logits stay float64: the exact-arithmetic parity mode).

    Summing lets the step divide by the token count of the whole optimizer step, so every
    token weighs the same whatever the micro-batching and data-parallel degree.
    """
    logits = at_least_float32(logits.flatten(0, 1))
    loss = F.cross_entropy(logits, labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX)
    # Under tensor parallelism's `loss_parallel()` the logits are vocabulary-sharded DTensors
    # and the loss a replicated DTensor: hand back a plain tensor (still differentiable).
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def labelled_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()


class StepLoss:
    """The loss `train_step` backpropagates: this rank's token-loss sum divided by
    `per_rank_tokens`, which the step sets before its first forward to the step's global
    count of labelled tokens over the data-parallel x context-parallel ranks; averaging the
    gradients over those ranks then gives the global token mean, whatever the layout, the
    micro-batching or the ignored labels. A pipeline schedule holds this object as its loss
    and reads the count at every micro-batch. 1 (as validation sets it): the plain sum."""

    def __init__(self, token_loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.token_loss_sum = token_loss_sum
        self.per_rank_tokens: torch.Tensor | float = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.token_loss_sum(logits, labels) / self.per_rank_tokens
