"""Throughput, achieved TFLOP/s and MFU from token counts and wall time."""

from __future__ import annotations


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
