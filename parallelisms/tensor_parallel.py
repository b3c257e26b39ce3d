"""Tensor parallelism with sequence parallelism (Megatron-style), applied from a family's plan.

A model family describes its TP plan as data (`models.tp_plan.TPPlan`: module path -> torch
`ParallelStyle`, for the root modules and for every block of `model.layers` and of the
multi-token-prediction modules, models/mtp.py) in its own
`plan.py`, registered as `ModelSpec.tp_plan`. This module applies any such plan and names no module of any model.
After applying it, every parameter must be a DTensor on the TP mesh: one the plan left out is
an error naming it (a plain tensor beside DTensors fails much later, at the first optimizer
step, naming nothing),
unless the plan lists its module under `REPLICATE`, which replicates it on the TP mesh.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_module
from torch.distributed.tensor.parallel import parallelize_module

from models import mtp
from models.tp_plan import REPLICATE, TPPlan
from parallelisms.parallel_dims import ParallelismError


def check_tp(n_heads: int, n_kv_heads: int, seq_len: int, tp: int) -> None:
    """Fails early (before process groups) when heads or sequence do not split over `tp`."""
    if tp <= 1:
        return
    problems = []
    if n_heads % tp:
        problems.append(f"n_heads = {n_heads}")
    if n_kv_heads % tp:
        problems.append(f"n_kv_heads = {n_kv_heads}")
    if seq_len % tp:
        problems.append(f"training.seq_len = {seq_len} (sequence parallelism splits it)")
    if problems:
        raise ParallelismError(
            f"parallelism.tensor_parallel_degree = {tp} must divide {', '.join(problems)}. "
            "Choose a tensor-parallel degree that divides the attention heads, the key/value "
            "heads and the sequence length."
        )


def _apply(module: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> None:
    present = {k: v for k, v in plan.items() if _submodules(module, k)}
    styles = {k: v for k, v in present.items() if v != REPLICATE}
    if styles:
        parallelize_module(module, tp_mesh, styles)
    for path in (k for k, v in present.items() if v == REPLICATE):
        for found in _submodules(module, path):
            distribute_module(found, tp_mesh)


def _submodules(module: nn.Module, path: str) -> list[nn.Module]:
    """The modules at `path`, whose parts may be `*` (any child), as `parallelize_module`
    reads its plan keys; [] when there is none (a pipeline stage without them, say)."""
    found = [module]
    for part in path.split("."):
        found = [c for m in found for name, c in m.named_children() if fnmatch(name, part)]
    return found


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> nn.Module:
    """Shards `model` (a whole model or a pipeline stage of one) over `tp_mesh` by `plan`;
    raises naming every parameter the plan leaves as a plain tensor."""
    _apply(model, tp_mesh, plan.root)
    for block in [*model.layers.values(), *mtp.blocks(model).values()]:
        _apply(block, tp_mesh, plan.block)
    missed = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if missed:
        raise ParallelismError(
            f"tensor parallelism: the model's TP plan covers no module of {len(missed)} "
            f"parameter(s): {', '.join(missed[:8])}{' ...' if len(missed) > 8 else ''}. Add "
            "their modules to the family's TPPlan (models/<name>/plan.py), with "
            "models.tp_plan.REPLICATE for parameters every rank keeps whole."
        )
    return model
