"""Materialise a meta-device model on its device and initialise it identically under every
layout: each parameter's full value is drawn from its own generator (seeded by the run seed
and the parameter's name; in float32 whatever the parameter's dtype, then cast), then each rank
keeps its shard. Any DP/TP/PP layout therefore starts from bit-identical weights, with no
seed checkpoint needed.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Wrappers that activation checkpointing and compile put into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter's name as in the plain model, whatever wrappers were applied."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Writes this rank's part of `full` into `param` (a plain tensor or a DTensor shard)."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            part = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(part.to_local())
        else:
            param.copy_(full)


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_weights(model: nn.Module, seed: int, device: torch.device | str | None = None) -> None:
    """Initialises every parameter of `model` (plain, sharded or a pipeline stage) by the
    model's own `init_param` rules, identically under every layout. Values are drawn on
    `device` (default: where each parameter lives): a CPU-offloaded run draws on its compute
    device, so it starts from the same weights as the same run without offload."""
    tied = model.tied_parameters() if hasattr(model, "tied_parameters") else {}
    for raw_name, param in model.named_parameters():
        name = canonical_name(raw_name)
        name = tied.get(name, name)  # a stage's copy of a tied weight starts as the weight
        local = param.to_local() if isinstance(param, DTensor) else param
        where = local.device if device is None else torch.device(device)
        gen = torch.Generator(device=where).manual_seed(param_seed(seed, name))
        # drawn in float32 whatever the parameter's dtype, then cast by the copy: a float64
        # run (the parity mode) starts from exactly the float32 run's weights
        full = torch.empty(param.shape, dtype=torch.float32, device=where)
        model.init_param(name, full, gen)
        copy_full_into(param, full)


def materialize(model: nn.Module, seed: int, device, init_device=None) -> nn.Module:
    """Meta-device model (or stage, sharded or not) -> real storage on `init_device` (default
    `device`), shared parameters tied again (`to_empty` gives each module its own), weights
    initialised identically under every layout (drawn on `device`), buffers filled."""
    model.to_empty(device=init_device or device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    with torch.no_grad():
        init_weights(model, seed, device)
    model.init_buffers(device)
    return model
