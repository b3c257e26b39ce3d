"""Training metrics: parameter/FLOP counts, device peaks, memory, throughput, logging.

This package imports no other meshtrain package; the trainer passes plain values in.
"""

from metrics.flops import count_params, flops_per_token
from metrics.logger import MetricsLogger, format_record
from metrics.memory import peak_memory_gib, reset_peak_memory
from metrics.peak_flops import (
    GPU_PEAKS,
    GpuPeaks,
    device_peak_flops,
    lookup_gpu_peak,
    match_gpu_name,
    measure_matmul_flops,
)
from metrics.throughput import throughput

__all__ = [
    "GPU_PEAKS",
    "GpuPeaks",
    "MetricsLogger",
    "count_params",
    "device_peak_flops",
    "flops_per_token",
    "format_record",
    "lookup_gpu_peak",
    "match_gpu_name",
    "measure_matmul_flops",
    "peak_memory_gib",
    "reset_peak_memory",
    "throughput",
]
