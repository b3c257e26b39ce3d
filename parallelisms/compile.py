"""Regional `torch.compile`: each transformer block is compiled on its own (identical blocks
share one compiled graph, so compile time does not grow with depth), and the loss.

Each block's `forward` is replaced by its compiled version in place, so parameter names
(FQNs) do not change, and module hooks (FSDP2's all-gather/reshard) keep running eagerly
around the compiled graph. Applied after tensor parallelism and activation checkpointing
(both are traced into the block's graph) and before FSDP/ZeRO.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def _own_input(module: nn.Module, args: tuple):
    """Gives a compiled block its own copy of an input that is a view: under tensor
    parallelism the first block's input is `DTensor.to_local()` of the embedding's output, and
    AOT autograd's handling of view inputs then loses that DTensor backward (torch 2.13 fails
    with "'Tensor' object has no attribute '_local_tensor'")."""
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x._is_view():
        return (x.clone(), *args[1:])
    return None


def apply_compile(model: nn.Module, part: str | None = None) -> nn.Module:
    """Compiles the forward of every entry of `model.layers` (`fullgraph`: a graph break is
    an error, not a silent slowdown); with `part`, of that submodule of every block instead
    (a family whose blocks hold data-dependent code, such as MoE routing, compiles the rest)."""
    for block in model.layers.values():
        target = getattr(block, part) if part else block
        target.forward = torch.compile(target.forward, fullgraph=True)
        target.register_forward_pre_hook(_own_input)
    return model


def maybe_compile_loss(loss_fn: Callable, compile_cfg) -> Callable:
    """`torch.compile(loss_fn)` when compile is enabled with "loss" among its components."""
    if compile_cfg.enable and "loss" in compile_cfg.components:
        return torch.compile(loss_fn)
    return loss_fn
