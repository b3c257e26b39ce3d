"""Expert parallelism: each rank of the "ep" mesh dimension holds n_experts / ep of every MoE
layer's experts, and tokens travel to their experts and back by all-to-all.

Applied to a family's experts module (`apply_ep`), which must take `(x, counts)` — the
(token, choice) rows sorted by expert, `counts[e]` rows for each of the E experts — and accept
`weights=` (the weights of the experts `counts` then covers). Its parameters become DTensors
sharded on the expert dimension (`Shard(0)` on "ep"), so checkpoints hold the full [E, ...]
tensors and reshard across EP degrees. Per forward:

1. dispatch: the counts go to every EP rank (one small all-to-all), then each rank's rows go
   to the ranks owning their experts (all-to-all with variable splits, so no token is
   dropped); the received rows are reordered expert-major for the local grouped matmul;
2. the local experts run on them, with the local shards of the weights;
3. combine: the outputs are put back in arrival order and returned by the reverse all-to-all,
   in the order the rows came in.
Backward runs the same exchanges the other way (`AllToAll`). The EP ranks are drawn from the
data-parallel shard dimension (see `parallel_dims.py`): they hold different tokens, like any
data-parallel ranks, and only the experts are split among them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

from parallelisms.parallel_dims import ParallelismError


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` with variable splits over rows; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        out = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return out, None, None, None


def _exchange_counts(counts: torch.Tensor, ep: int, group) -> torch.Tensor:
    """counts [E] of this rank's rows -> [ep, E / ep]: row s = the rows rank s sends for each
    of this rank's experts."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, -1)


def _expert_major(received: torch.Tensor) -> torch.Tensor:
    """Permutation taking rows that arrived source-major ([source, local expert] segments) to
    expert-major order (stable within each expert: by source rank, then arrival)."""
    ep, local = received.shape
    source_major = torch.arange(ep * local, device=received.device)
    key = (source_major % local) * ep + source_major // local  # expert-major rank of a segment
    row_key = torch.repeat_interleave(key, received.flatten())
    return torch.argsort(row_key, stable=True)


def _dispatch(module: nn.Module, inputs, mesh: DeviceMesh):
    x, counts = inputs[0], inputs[1]
    ep, group = mesh.size(), mesh.get_group()
    received = _exchange_counts(counts, ep, group)
    in_splits = counts.view(ep, -1).sum(1).tolist()
    out_splits = received.sum(1).tolist()
    arrived = AllToAll.apply(x, out_splits, in_splits, group)
    perm = _expert_major(received)
    module._ep_combine = (perm, in_splits, out_splits, group)
    weights = tuple(getattr(module, n).to_local() for n in module._ep_names)
    return arrived[perm], received.sum(0), weights


def _combine(module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    perm, in_splits, out_splits, group = module._ep_combine
    module._ep_combine = None
    arrival = out[torch.argsort(perm)]
    return AllToAll.apply(arrival, in_splits, out_splits, group)


def _distribute_experts(experts: nn.Module, mesh: DeviceMesh, names, placement, **hooks):
    def partition(_: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if module is experts:
            for n in names:
                p = distribute_tensor(getattr(module, n), mesh, [placement])
                module.register_parameter(n, nn.Parameter(p))

    experts._ep_names = tuple(names)
    return distribute_module(experts, mesh, partition, **hooks)


def apply_ep(experts: nn.Module, ep_mesh: DeviceMesh, param_names: tuple[str, ...]) -> nn.Module:
    """Shards `experts`' parameters `param_names` ([E, ...] each) over `ep_mesh` on the expert
    dimension and routes its inputs and outputs by all-to-all (see the module doc)."""
    n_experts = getattr(experts, param_names[0]).shape[0]
    if n_experts % ep_mesh.size():
        raise ParallelismError(
            f"expert parallelism: {n_experts} experts do not split over "
            f"expert_parallel_degree = {ep_mesh.size()}; choose a degree that divides them."
        )
    return _distribute_experts(
        experts, ep_mesh, param_names, Shard(0), input_fn=_dispatch, output_fn=_combine
    )


def _local_weights(module: nn.Module, inputs, mesh: DeviceMesh):
    return (*inputs[:2], tuple(getattr(module, n).to_local() for n in module._ep_names))


def replicate_experts(experts: nn.Module, tp_mesh: DeviceMesh, param_names) -> nn.Module:
    """Under TP without EP: every TP rank holds all experts (replicated DTensors on "tp") and
    runs them on the tokens it shares with its TP peers."""
    return _distribute_experts(experts, tp_mesh, param_names, Replicate(), input_fn=_local_weights)
