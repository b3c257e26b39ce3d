"""Regional `torch.compile`: each transformer block is compiled on its own (identical blocks
share one compiled graph, so compile time does not grow with depth), and the loss.

`block.compile()` compiles the module in place, so parameter names (FQNs) do not change.
Applied after tensor parallelism and activation checkpointing (both are traced into the
block's graph) and before FSDP/ZeRO, whose hooks run around the compiled blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def apply_compile(model: nn.Module) -> nn.Module:
    """Compiles every entry of `model.layers` in place (`fullgraph`: no silent graph breaks)."""
    for block in model.layers.values():
        block.compile(fullgraph=True)
    return model


def maybe_compile_loss(loss_fn: Callable, compile_cfg) -> Callable:
    """`torch.compile(loss_fn)` when compile is enabled with "loss" among its components."""
    if compile_cfg.enable and "loss" in compile_cfg.components:
        return torch.compile(loss_fn)
    return loss_fn
