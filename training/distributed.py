"""Process setup: device and backend choice, process group, seeds, determinism, teardown."""

from __future__ import annotations

import gc
import logging
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger("meshtrain")


class LaunchError(RuntimeError):
    """A problem with the launch environment (ranks, devices), reported before training."""


def launch_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's variables; (0, 0, 1) for plain python."""
    try:
        rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
    except ValueError as e:
        raise LaunchError(f"RANK/LOCAL_RANK/WORLD_SIZE must be integers: {e}") from None
    if world_size > 1 and "MASTER_ADDR" not in os.environ:
        raise LaunchError(
            f"WORLD_SIZE={world_size} but MASTER_ADDR is not set: launch with torchrun "
            "(e.g. torchrun --standalone --nproc_per_node 2 train.py ...)."
        )
    return rank, local_rank, world_size


def device_type(choice: str) -> str:
    """What `training.device` resolves to on this machine: `auto` = CUDA when present."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def pick_device(choice: str, local_rank: int) -> torch.device:
    """`auto` = this rank's CUDA device when GPUs are present, else the CPU."""
    if device_type(choice) == "cuda":
        if not torch.cuda.is_available():
            raise LaunchError(
                "training.device = 'cuda' but no CUDA device is visible; use --training.device cpu."
            )
        if local_rank >= torch.cuda.device_count():
            raise LaunchError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
                "launch at most one process per GPU (torchrun --nproc_per_node)."
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def process_group_backend(device_type: str, world_size: int, cpu_offload: bool = False) -> str:
    """NCCL for CUDA, gloo for CPU; CUDA with CPU offload needs both, since the offloaded
    gradients' norm (clipping) is reduced across ranks on the host. One rank moves no data
    between GPUs (a few scalar all-reduces, which gloo also runs on CUDA tensors): gloo, so a
    single-GPU run does not depend on NCCL setting up a communicator."""
    if device_type != "cuda" or world_size == 1:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def init_process_group(
    device: torch.device, world_size: int, timeout_s: int, cpu_offload: bool = False
) -> None:
    """`process_group_backend`'s backend. A plain `python train.py` gets a one-rank group on
    an in-memory store, so the mesh, DTensor and DCP code paths are the same for every launch."""
    if dist.is_initialized():
        return
    backend = process_group_backend(device.type, world_size, cpu_offload)
    kwargs = {"device_id": device} if "nccl" in backend else {}  # NCCL's eager init
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    elif "TORCHELASTIC_RESTART_COUNT" in os.environ and "MASTER_ADDR" in os.environ:
        # torchrun keeps one store across restarts: without a per-attempt prefix a restarted
        # rank can read a dead peer's gloo/NCCL address left by the previous attempt.
        store, rank, size = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        kwargs.update(
            store=dist.PrefixStore(f"meshtrain/attempt{attempt}", store), rank=rank, world_size=size
        )
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)


def set_collective_timeout(timeout_s: int) -> None:
    """Switches every process group this rank belongs to (the default one and the mesh's
    sub-groups, which inherit the set-up timeout) to the steady-state timeout."""
    if not dist.is_initialized():
        return
    c10d = dist.distributed_c10d
    for group in list(c10d._world.pg_map):
        if isinstance(group, dist.ProcessGroup) and not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)


def seed_everything(seed: int, deterministic: bool) -> None:
    """Same seed on every rank (weights are drawn per parameter name, not from these streams;
    a family with dropout would want per-rank streams for its masks)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def record_error(error: BaseException) -> None:
    """Writes `error` to this rank's torchrun error file (TORCHELASTIC_ERROR_FILE; what
    torchrun's `record` decorator writes for an uncaught exception), so that torchrun's failure
    summary gives each failed rank's own error instead of "error_file: <N/A>". For errors
    training.launch catches and turns into an exit status; call it in their except block. Without
    torchrun (no error file) it does nothing."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(error)


def cleanup() -> None:
    """Destroys the process groups while the interpreter is fully alive. Modules with hooks
    form reference cycles that keep groups (and gloo's finished work objects) alive until a
    garbage collection; left to interpreter shutdown, a gloo worker thread that frees a tensor
    there aborts the process ("terminate called without an active exception")."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
