"""Bytes this rank really holds in parameters, gradients and optimizer state.

Counts storages, not tensors: a DTensor counts its local shard, views count their whole
underlying storage once (padding included), and a storage shared by two roles (a ZeRO master
shard that is a view of the full parameter) counts once, under the first role. Besides the
registered parameters this sees ZeRO's full compute parameters and FSDP2's gathered
parameters when they are allocated. Call it after `optimizer.step()` and before
`zero_grad()`, when gradients and optimizer state both exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

GIB = 2**30


@dataclass
class MemoryReport:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_metrics(self) -> dict[str, float]:
        return {
            "params_gib": self.params / GIB,
            "grads_gib": self.grads / GIB,
            "optimizer_gib": self.optimizer / GIB,
            "total_gib": self.total / GIB,
        }

    def __str__(self) -> str:
        mib = 2**20
        return (
            f"held per rank: params {self.params / mib:.2f} MiB, grads {self.grads / mib:.2f} "
            f"MiB, optimizer state {self.optimizer / mib:.2f} MiB, total {self.total / mib:.2f} MiB"
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _extra_params(module: nn.Module) -> Iterable[torch.Tensor]:
    """Full parameters that are not registered right now: ZeRO's compute views and FSDP2's
    gathered (unsharded) parameters."""
    zero = getattr(module, "_zero", None)
    if zero is not None:
        for p in zero.params:
            yield p.compute
    for sub in module.modules():
        state = getattr(sub, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        for fp in getattr(group, "fsdp_params", ()):
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                yield unsharded


def _grads(module: nn.Module) -> Iterable[torch.Tensor]:
    for p in module.parameters():
        yield p.grad
    zero = getattr(module, "_zero", None)
    if zero is not None:
        for p in zero.params:
            yield p.compute.grad


class _Counter:
    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def add(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            local = _local(t)
            if local.device.type == "meta":
                continue
            storage = local.untyped_storage()
            key = (str(local.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in self.seen:
                continue
            self.seen.add(key)
            total += storage.nbytes()
        return total


def _param_bytes(counter: _Counter, model_parts: list[nn.Module]) -> int:
    return sum(counter.add([*part.parameters(), *_extra_params(part)]) for part in model_parts)


def param_bytes(model_parts: list[nn.Module]) -> int:
    """This rank's parameter bytes alone (registered, ZeRO compute and FSDP2 gathered)."""
    return _param_bytes(_Counter(), model_parts)


def memory_report(model_parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> MemoryReport:
    """This rank's parameter, gradient and optimizer-state bytes (see the module doc)."""
    counter = _Counter()
    params = _param_bytes(counter, model_parts)
    grads = sum(counter.add(_grads(part)) for part in model_parts)
    optimizers = getattr(optimizer, "optimizers", [optimizer])
    state = [
        v
        for opt in optimizers
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    return MemoryReport(params, grads, counter.add(state))
