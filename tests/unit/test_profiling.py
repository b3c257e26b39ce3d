"""Profiling, in this process: the compute/communication breakdown of a trace and the per-step
phase timer. A real 2-rank run: tests/integration/test_profiling_run.py."""

import time
from pathlib import Path
from types import SimpleNamespace

import torch

from metrics.profiling import PhaseTimer, _minus, _union, comm_breakdown

ROOT = Path(__file__).resolve().parents[2]


def _kernel(name: str, start_us: float, end_us: float):
    return SimpleNamespace(
        name=name,
        device_type=torch.autograd.DeviceType.CUDA,
        time_range=SimpleNamespace(start=start_us, end=end_us),
    )


def test_exposed_communication_is_comm_time_not_covered_by_compute():
    events = [
        _kernel("ampere_bf16_gemm", 0, 10e6),
        _kernel("ncclDevKernel_AllGather_RING_LL", 5e6, 15e6),  # 5 s hidden, 5 s exposed
        _kernel("ncclDevKernel_ReduceScatter", 12e6, 14e6),  # inside the exposed part
        _kernel("flash_fwd_kernel", 20e6, 21e6),
    ]
    out = comm_breakdown(events, "cuda")
    assert out == {"compute_s": 11.0, "comm_s": 10.0, "exposed_comm_s": 5.0}
    assert _minus(_union([(0, 10)]), _union([(2, 3), (5, 6), (9, 12)])) == 7


def test_phase_timer_averages_phases_between_pops():
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(2):
        timer.start()
        time.sleep(0.02)
        timer.mark("forward_backward")
        timer.mark("optimizer")
    out = timer.pop()
    assert set(out) == {"forward_backward", "optimizer"}
    assert 0.015 < out["forward_backward"] < 0.5 and out["optimizer"] < 0.01
    assert timer.pop() == {}
