"""Throughput, achieved TFLOP/s and MFU from token counts and wall time."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


def throughput(
    tokens: int, seconds: float, flops_per_token: float, peak_flops: float
) -> dict[str, float]:
    """Per-device rates for ``tokens`` processed on one device in ``seconds``.

    Returns ``tokens_per_sec``, ``tflops`` (achieved TFLOP/s per device) and ``mfu``
    (percent of ``peak_flops``). Non-positive ``seconds`` gives zero rates and a
    non-positive ``peak_flops`` gives zero MFU, so a bad reading never crashes training.
    """
    if seconds <= 0:
        return {"tokens_per_sec": 0.0, "tflops": 0.0, "mfu": 0.0}
    tokens_per_sec = tokens / seconds
    achieved = tokens_per_sec * flops_per_token
    mfu = 100.0 * achieved / peak_flops if peak_flops > 0 else 0.0
    return {"tokens_per_sec": tokens_per_sec, "tflops": achieved / 1e12, "mfu": mfu}


@dataclass(frozen=True)
class Window:
    """Totals over the steps since the last log."""

    steps: int
    tokens: int
    seconds: float
    data_seconds: float

    @property
    def step_time_s(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0

    @property
    def data_time_s(self) -> float:
        return self.data_seconds / self.steps if self.steps else 0.0


@dataclass
class StepTimer:
    """Accumulates per-device tokens and data-loading time between log steps.

    Wall time runs from construction (or the last ``pop``) to the next ``pop``. On GPUs
    the trainer must synchronise before ``pop`` (reading the loss with ``.item()`` does)
    so queued kernels are inside the window.
    """

    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    _start: float = field(init=False)
    _steps: int = field(init=False, default=0)
    _tokens: int = field(init=False, default=0)
    _data_seconds: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self._start = self.clock()

    def add_step(self, tokens: int, data_time_s: float = 0.0) -> None:
        """Record one optimizer step that processed ``tokens`` on this device."""
        self._steps += 1
        self._tokens += tokens
        self._data_seconds += data_time_s

    def pop(self) -> Window:
        """Return the totals since the last ``pop`` and start a new window."""
        now = self.clock()
        window = Window(self._steps, self._tokens, now - self._start, self._data_seconds)
        self._start = now
        self._steps, self._tokens, self._data_seconds = 0, 0, 0.0
        return window
