"""The host copy of an async checkpoint: what the background writer serialises while training
goes on.

Why not torch's stagers: both (`FileSystemWriter`'s blocking one and `DefaultStager`) deep-copy
CPU DTensors, and torch 2.13 fails to deep-copy a DTensor whose local tensor is a view at a
storage offset ("Attempted to call copy_() on an invalid python storage"), which is what
ZeRO-1/2's master shards are on every rank but the first. This stager copies each tensor's
local data into a host buffer and rebuilds DTensors around the copies, so every layout saves
asynchronously. Host buffers are kept between saves (one save runs at a time: the manager
waits for the previous one first), pinned on CUDA so the copies can be asynchronous.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class HostCopyStager:
    """A `torch.distributed.checkpoint` AsyncStager. `background`: `stage` returns a Future and
    copies in a worker thread (the caller must wait for it before changing the weights: the
    checkpoint manager's optimizer hook does); otherwise it copies before returning."""

    def __init__(self, *, background: bool, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-stage") if background else None
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # a foreground copy is done on return; a background one is a Future

    def synchronize_staging(self) -> None:
        pass

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future:
        if self._pool is None:
            return self._copy_all(state_dict)
        return self._pool.submit(self._copy_all, state_dict)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._buffers.clear()

    def _copy_all(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = self._copy(state_dict, "")
        if self.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        return out

    def _copy(self, value: Any, path: str) -> Any:
        if isinstance(value, dict):
            return {k: self._copy(v, f"{path}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._copy(v, f"{path}/{i}") for i, v in enumerate(value)]
            return type(value)(items) if isinstance(value, list) else tuple(items)
        if isinstance(value, DTensor):
            local = self._host(value.to_local(), path)
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._host(value, path)
        return copy.deepcopy(value)

    def _host(self, tensor: torch.Tensor, path: str) -> torch.Tensor:
        """A host copy of `tensor` in the buffer kept for `path` (made on first use)."""
        tensor = tensor.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            pin = self.pin_memory and tensor.device.type == "cuda"
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        buf.copy_(tensor, non_blocking=buf.is_pinned())
        return buf
