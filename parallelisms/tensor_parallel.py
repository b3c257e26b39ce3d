"""Tensor parallelism with sequence parallelism (Megatron-style), applied from a family's plan.

A model family describes its TP plan as data (`TPPlan`: module path -> torch `ParallelStyle`,
for the root modules and for every block of `model.layers`) in its own `plan.py`, registered
as `ModelSpec.tp_plan`. This module applies any such plan and names no module of any model.
After applying it, every parameter must be a DTensor on the TP mesh: one the plan left out is
an error naming it (a plain tensor beside DTensors fails much later, at the first optimizer
step, naming nothing),
unless the plan lists its module under `REPLICATE`, which replicates it on the TP mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

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


# A plan value that replicates a module's parameters on the TP mesh (no sharding, no layout
# change of its inputs/outputs): for small parameters that each rank needs whole.
REPLICATE = "replicate"


class ReplicateParallel(ParallelStyle):
    """A module whose parameters every TP rank keeps whole and whose (plain, identical across
    the TP ranks) inputs it runs on: parameters replicated on the TP mesh, inputs wrapped as
    replicated DTensors, outputs returned as plain tensors (a router on the tokens the TP ranks
    share, say). Its gradients are then equal on every TP rank, as its inputs are."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def wrap(_, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs
            )

        def unwrap(_, output, mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, input_fn=wrap, output_fn=unwrap)


@dataclass(frozen=True)
class TPPlan:
    """A family's TP plan: module paths (relative to the model root, or to each block of
    `model.layers`) -> a `ParallelStyle` or `REPLICATE`. Root entries whose module is absent
    (a pipeline stage without the embeddings, say) are skipped."""

    root: dict[str, ParallelStyle | str] = field(default_factory=dict)
    block: dict[str, ParallelStyle | str] = field(default_factory=dict)


def _apply(module: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> None:
    present = {k: v for k, v in plan.items() if _submodule(module, k) is not None}
    styles = {k: v for k, v in present.items() if v != REPLICATE}
    if styles:
        parallelize_module(module, tp_mesh, styles)
    for path in (k for k, v in present.items() if v == REPLICATE):
        distribute_module(_submodule(module, path), tp_mesh)


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> nn.Module:
    """Shards `model` (a whole model or a pipeline stage of one) over `tp_mesh` by `plan`;
    raises naming every parameter the plan leaves as a plain tensor."""
    _apply(model, tp_mesh, plan.root)
    for block in model.layers.values():
        _apply(block, tp_mesh, plan.block)
    missed = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if missed:
        raise ParallelismError(
            f"tensor parallelism: the model's TP plan covers no module of {len(missed)} "
            f"parameter(s): {', '.join(missed[:8])}{' ...' if len(missed) > 8 else ''}. Add "
            "their modules to the family's TPPlan (models/<name>/plan.py), with "
            "tensor_parallel.REPLICATE for parameters every rank keeps whole."
        )
    return model
