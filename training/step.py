"""The one training step every layout runs, and the global gradient-norm clip."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from models.numerics import at_least_float32, at_least_float32_dtype
from training.inputs import SequenceSplit
from training.loss import StepLoss, labelled_tokens


@dataclass
class StepSetup:
    """What `train_step` needs besides the batch; built once by the trainer."""

    model_parts: list[nn.Module]
    # the token-loss sum over the step's global token count (`train_step` sets the count)
    loss_fn: StepLoss
    pp_schedule: object | None = None  # a torch.distributed.pipelining schedule
    pp_first_stage: bool = True
    pp_last_stage: bool = True
    # forward, loss and backward run in `loss_context` (loss parallel under TP); forward and
    # loss alone in `autocast` (bf16 where no FSDP/ZeRO casts the weights): backward runs
    # outside autocast, as PyTorch advises, and the autocast weight cache is freed before it
    loss_context: Callable[[], contextlib.AbstractContextManager] = field(
        default=contextlib.nullcontext
    )
    autocast: Callable[[], contextlib.AbstractContextManager] = field(
        default=contextlib.nullcontext
    )
    # how a loaded batch becomes this rank's model inputs (CP shard, attention coordinates)
    split: SequenceSplit = field(default_factory=SequenceSplit)
    # tied weights a pipeline split keeps as two copies (parallelisms.tied_weights)
    tied: object | None = None


def _set_grad_sync(model_parts: list[nn.Module], enabled: bool) -> None:
    """FSDP2 reduces gradients only on the last micro-step of an accumulation window."""
    for part in model_parts:
        if hasattr(part, "set_requires_gradient_sync"):
            part.set_requires_gradient_sync(enabled)


def _reduce_local_gradients(model_parts: list[nn.Module]) -> None:
    """Data-parallel wrappers that reduce gradients in hooks (ZeRO 0-2) reduce here, once per
    pipeline schedule step, what its backward passes accumulated with sync off (torch calls
    FSDP2's reduction itself)."""
    for part in model_parts:
        for module in part.modules():
            if hasattr(module, "reduce_local_gradients"):
                module.reduce_local_gradients()


def _pp_step_kwargs(schedule) -> dict:
    """Where torch allows it (newer than some 2.x releases), the last stage does not keep
    every microbatch's full logits as step outputs: they are large and unused here."""
    accepts = "return_outputs" in inspect.signature(schedule.step).parameters
    return {"return_outputs": False} if accepts else {}


def pipeline_call(setup: StepSetup, inputs: torch.Tensor, labels: torch.Tensor):
    """(args, target, losses) of a pipeline schedule call on this rank: the first stage feeds
    the inputs, the last takes the labels and collects one loss per microbatch."""
    last = setup.pp_last_stage
    return (
        ((inputs,) if setup.pp_first_stage else ()),
        (labels if last else None),
        ([] if last else None),
    )


def train_step(setup: StepSetup, microbatches: list[tuple[torch.Tensor, torch.Tensor, dict]]):
    """Forward and backward over every micro-step, each (inputs, labels, model keyword
    arguments) as `sequence_inputs` gives them; returns this rank's mean loss (a tensor, zero
    on pipeline stages that do not compute the loss). No host sync happens here."""
    # the loss's dtype on every rank (float64 in the float64 mode): pipeline stages without
    # the loss join the logged loss's all-reduce with this zero, and need the same dtype
    weights = next(setup.model_parts[0].parameters()).dtype
    total = torch.zeros((), device=microbatches[0][0].device, dtype=at_least_float32_dtype(weights))
    setup.loss_fn.per_rank_tokens = mean_over_ranks(
        sum(labelled_tokens(labels) for _, labels, _ in microbatches).to(total.dtype)
    )
    for i, (inputs, labels, kwargs) in enumerate(microbatches):
        sync = i == len(microbatches) - 1
        with setup.loss_context():
            if setup.pp_schedule is None:
                _set_grad_sync(setup.model_parts, sync)
                with setup.autocast():
                    loss = setup.loss_fn(setup.model_parts[0](inputs, **kwargs), labels)
                loss.backward()
                total += loss.detach()
            else:
                args, target, losses = pipeline_call(setup, inputs, labels)
                # ZeRO 0-2 reduce once after the schedule, not in each microbatch's backward
                # (torch's pipelining drives FSDP2's flag and reduction itself)
                _set_grad_sync(setup.model_parts, False)
                with setup.autocast():  # the schedule runs the backward passes itself
                    # every stage gets the keyword arguments, split into microbatches
                    setup.pp_schedule.step(
                        *args,
                        target=target,
                        losses=losses,
                        **kwargs,
                        **_pp_step_kwargs(setup.pp_schedule),
                    )
                _set_grad_sync(setup.model_parts, sync)
                _reduce_local_gradients(setup.model_parts)
                if sync and setup.tied is not None:  # once per step, on reduced gradients
                    setup.tied.sum_gradients()
                if setup.pp_last_stage:
                    total += torch.stack([x.detach() for x in losses]).sum()
    return total


def clip_grad_norm_(
    parameters: list[torch.Tensor],
    max_norm: float,
    pp_group: dist.ProcessGroup | None = None,
    uncounted: list[torch.Tensor] = (),
) -> torch.Tensor:
    """Clips to the true global L2 norm across every mesh dimension and pipeline stage.

    Gradients are grouped by kind (plain tensors, and DTensors per mesh and placements: e.g.
    FSDP x TP shards, ZeRO-1/2 shards, TP-only replicas), each group's norm is completed over
    its mesh (`full_tensor` sums the shards' squares), and the groups' squares are added.
    `uncounted` (among `parameters`): clipped, but left out of the norm (a tied weight's
    second copy, whose gradient the first already counts)."""
    groups: dict[object, list[torch.Tensor]] = {}
    skip = {id(p) for p in uncounted}
    for p in parameters:
        if p.grad is not None and id(p) not in skip:
            g = p.grad
            key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(p)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:  # e.g. a pipeline stage without gradients still joins the PP reduction
        # in the other stages' dtype (the weights'): the all-reduce below needs one dtype
        dtype = at_least_float32_dtype(parameters[0].dtype) if parameters else None
        norm = torch.zeros((), device=parameters[0].device if parameters else None, dtype=dtype)
    elif len(norms) == 1:
        norm = norms[0]
    else:
        norm = torch.stack([at_least_float32(n) for n in norms]).norm()
    if pp_group is not None:
        norm = norm**2
        dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_group)
        norm = norm.sqrt()
    if max_norm > 0:
        for params in [*groups.values(), *([p] for p in uncounted if p.grad is not None)]:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def mean_over_ranks(count: torch.Tensor) -> torch.Tensor:
    """A per-rank count's mean over all ranks, on the device (no host sync): for the step's
    labelled tokens, the global count over the data-parallel x context-parallel ranks divided
    by their number (TP and pipeline ranks hold copies of their group's labels, which scale
    the sum and the rank count alike)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        count = count.clone()
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
        return count / dist.get_world_size()
    return count


def global_mean(value: torch.Tensor, replicas: int) -> float:
    """Averages a per-rank scalar over all ranks, given how many ranks hold each value's
    copy (e.g. TP ranks); pipeline stages without a loss contribute zero."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value.item() / replicas
    return value.item()
