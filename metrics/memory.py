"""Device memory readings in GiB for the training log."""

from __future__ import annotations

import os
import resource
import sys

import torch

GIB = float(1 << 30)


def _max_rss_bytes() -> int:
    """Process peak resident set size; ``ru_maxrss`` is KiB on Linux, bytes on macOS."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def process_rss_gib() -> float | None:
    """This process's resident set size now (Linux ``/proc``); None where that is missing.
    Read before the model is built, it is the runtime's own share (interpreter, libraries,
    process groups), which the peak RSS includes but no parallelism can shard."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB
    except (OSError, ValueError, IndexError):
        return None


def _is_accelerator(device: torch.device) -> bool:
    return device.type != "cpu" and torch.accelerator.is_available()


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated memory since the last reset: CUDA ``max_memory_allocated``, CPU peak RSS.

    On CPU this is the whole process's peak RSS (includes Python, libraries and data
    buffers) and cannot be reset.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    if _is_accelerator(device):
        return torch.accelerator.max_memory_allocated(device) / GIB
    return _max_rss_bytes() / GIB


def reset_peak_memory(device: torch.device) -> None:
    """Reset the peak counter read by ``peak_memory_gib`` (a no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif _is_accelerator(device):
        torch.accelerator.reset_peak_memory_stats(device)
