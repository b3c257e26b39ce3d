"""FSDP2 (`fully_shard`): ZeRO-3 per unit, HSDP on the 2-D (dp_replicate, dp_shard) mesh.

The family names its units (`FsdpUnit`, usually `embed_blocks_head_units`);
`parallelisms/data_parallel.py` decides when a run uses FSDP rather than `apply_zero`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from models import mtp
from parallelisms.parallel_dims import ParallelDims


def fsdp_mesh(parallel_dims: ParallelDims, shard_dim: str = "dp_shard_cp") -> DeviceMesh:
    """The mesh FSDP shards over: 2-D ("dp_replicate", `shard_dim`) for HSDP, else 1-D.
    "dp_shard_cp" is "dp_shard" without context parallelism; `shard_dim` "dp_shard_mod_ep":
    the experts' mesh under expert parallelism."""
    if parallel_dims.dp_replicate > 1:
        return parallel_dims.mesh[("dp_replicate", parallel_dims.dim_name(shard_dim))]
    return parallel_dims.dim(shard_dim)


@dataclass
class FsdpUnit:
    """Modules sharded and gathered together (one `fully_shard` call), from the model family:
    "input" units are used first in forward (token embeddings), "block" units are the
    transformer blocks in order, "output" units are used last in forward and first in backward
    (final norm and output projection). Tied parameters must sit in one unit."""

    modules: list[nn.Module]
    role: Literal["input", "block", "output", "experts"]
    # "experts" units (inside a block, sharded before it): the expert-parallel experts, sharded
    # over `mesh` (the ranks outside EP); their gradients hold the sum over the EP ranks'
    # tokens, so the reduction divides by `gradient_divide_factor` (the whole DP degree).
    mesh: DeviceMesh | None = None
    gradient_divide_factor: float | None = None


def embed_blocks_head_units(
    model: nn.Module, first: list[str], last: list[str], tied: bool
) -> list[FsdpUnit]:
    """The usual units of a decoder, from the family's module names: its `first` modules (token
    embeddings) as an input unit, each block of `model.layers` and each multi-token-prediction
    module (models/mtp.py) after them, its `last` modules (final norm,
    output projection) as one output unit. `tied`: the first modules join the output unit, since
    FSDP shards a parameter in one unit only. Modules absent from a pipeline stage are left out."""

    def present(names: list[str]) -> list[nn.Module]:
        return [m for n in names if (m := getattr(model, n, None)) is not None]

    blocks = [FsdpUnit([block], "block") for block in [*model.layers.values(), *mtp.modules(model)]]
    if tied:
        units = [*blocks, FsdpUnit(present(first + last), "output")]
    else:
        units = [FsdpUnit(present(first), "input"), *blocks, FsdpUnit(present(last), "output")]
    return [u for u in units if u.modules]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    units: list[FsdpUnit],
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
    pp_enabled: bool = False,
    pin_memory: bool = True,
) -> nn.Module:
    """ZeRO-3: shards each of the family's units, then the root.

    Per-block units keep each all-gather one block wide so it overlaps the previous block's
    compute. `reshard_after_forward`: "always" frees gathered weights after forward
    (re-gathered in backward), "never" keeps them until backward (no re-gather, more memory),
    "default" frees them except for the last block, whose backward starts right away, and
    never under pipeline parallelism, whose schedules run many forwards before backwards.
    On a 2-D mesh this is HSDP: shard over "dp_shard", replicate (all-reduce) over
    "dp_replicate".
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = {"mesh": dp_mesh, "mp_policy": mp}
    if cpu_offload:
        # Pinned host memory makes the host<->GPU copies async; it needs an accelerator.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    blocks = [u for u in units if u.role == "block"]
    last_block = blocks[-1] if blocks else None
    for unit in units:
        modules = unit.modules if len(unit.modules) > 1 else unit.modules[0]
        is_last = unit is last_block
        reshard = _reshard_unit(unit.role, is_last, reshard_after_forward, pp_enabled)
        fully_shard(
            modules, reshard_after_forward=reshard, **{**kwargs, "mesh": unit.mesh or dp_mesh}
        )
        if unit.gradient_divide_factor is not None:
            _divide_gradients_by(modules, unit.mesh or dp_mesh, unit.gradient_divide_factor)
        if unit.role == "input" and all(isinstance(m, nn.Embedding) for m in unit.modules):
            _no_regather_in_backward(unit.modules)
    # The root holds no parameters of its own now; it runs FSDP's lazy init and waits for the
    # last reduce-scatters at the end of backward.
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **kwargs)
    return model


def _reshard_unit(role: str, last_block: bool, mode: str, pp_enabled: bool) -> bool:
    """Whether a unit frees its gathered parameters after forward under `mode` (see
    apply_fsdp's `reshard_after_forward`)."""
    always = mode == "always"
    default = mode == "default" and not pp_enabled
    if role == "input":
        # Used first in forward and last in backward: freed after forward, so a large
        # vocabulary is not held gathered through the whole step.
        return always or default
    if role in ("block", "experts"):
        return always or (default and not last_block)
    # Output: used last in forward and first in backward, so kept gathered between the two
    # (no re-gather), freed after its backward.
    return always


def _divide_gradients_by(module: nn.Module, mesh: DeviceMesh, factor: float) -> None:
    """The unit's reduced gradients are divided by `factor` instead of the FSDP group size.
    Over several shard ranks they are summed, then divided (gloo has no PREMUL_SUM, which FSDP2
    would use otherwise). Over one shard rank no reduce-scatter runs, and FSDP2 (torch 2.13)
    divides the copy it makes by `factor`, then, in a reduce dtype other than float32/bfloat16
    (float64), by its own pre- and post-division factors again: `factor` squared. So there
    FSDP2 only sums (factor 1: no division in any dtype) and a hook divides once, after the
    HSDP all-reduce where there is one (forcing a sum would also divide twice)."""
    if mesh.size(mesh.ndim - 1) > 1:
        module.set_gradient_divide_factor(factor)
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
        return
    module.set_gradient_divide_factor(1.0)
    module.set_all_reduce_hook(lambda reduced: reduced.div_(factor))


def _no_regather_in_backward(embeddings: list[nn.Module]) -> None:
    """An embedding's backward needs the indices and the output gradient, not the weight: never
    gathered again (its gradient is reduce-scattered at the end of backward). nn.Embedding
    returns a view of its gather; FSDP2 warns that an in-place op on it would skip the
    pre-backward all-gather. The blocks only add to it out of place (the parity tests check the
    gradients), so the warning would be noise in every log."""
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module \(FSDP\w+\) returned a view tensor"
    )
    for m in embeddings:
        m.set_unshard_in_backward(False)
