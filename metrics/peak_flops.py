"""Peak FLOP/s of the training device, the denominator of MFU.

CUDA/ROCm devices use datasheet dense (no sparsity) tensor-core peaks looked up by
device name; unknown accelerators and CPUs fall back to a short measured matmul rate.
Measured rates can be cached as JSON so later runs skip the calibration.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import re
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger("meshtrain")

CACHE_FILE_NAME = "peak_flops_cache.json"
_CPU_MAX_SIZE = 2048
_CPU_MIN_SIZE = 256
_CPU_GROW_BELOW_S = 0.05
_CPU_BUDGET_S = 1.0
_CPU_REFRESH_SIZE = 1024
_GPU_MEASURE_SIZE = 8192


@dataclass(frozen=True)
class GpuPeaks:
    """Dense datasheet peaks in FLOP/s; ``None`` where the format is unsupported."""

    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float | None
    fp8: float | None = None


# Keyed by the name tokens that must all appear in ``torch.cuda.get_device_name()``;
# the most specific (most tokens) match wins, so "H100" alone means the SXM part.
# Numbers are dense (without 2:4 sparsity) from the vendors' datasheets.
GPU_PEAKS: dict[str, GpuPeaks] = {
    # NVIDIA Ampere
    "A100": GpuPeaks(bf16=312e12, fp16=312e12, tf32=156e12, fp32=19.5e12),
    "A800": GpuPeaks(bf16=312e12, fp16=312e12, tf32=156e12, fp32=19.5e12),
    "A10": GpuPeaks(bf16=125e12, fp16=125e12, tf32=62.5e12, fp32=31.2e12),
    # AWS A10G: GA102 with half-rate FP32-accumulate tensor math (AWS-quoted figures).
    "A10G": GpuPeaks(bf16=70e12, fp16=70e12, tf32=35e12, fp32=31.2e12),
    "A40": GpuPeaks(bf16=149.7e12, fp16=149.7e12, tf32=74.8e12, fp32=37.4e12),
    # NVIDIA Ada
    "L4": GpuPeaks(bf16=121e12, fp16=121e12, tf32=60e12, fp32=30.3e12, fp8=242e12),
    "L40": GpuPeaks(bf16=181e12, fp16=181e12, tf32=90.5e12, fp32=90.5e12, fp8=362e12),
    "L40S": GpuPeaks(bf16=362e12, fp16=362e12, tf32=183e12, fp32=91.6e12, fp8=733e12),
    # NVIDIA Hopper
    "H100": GpuPeaks(bf16=989e12, fp16=989e12, tf32=494.7e12, fp32=66.9e12, fp8=1979e12),
    "H100 PCIE": GpuPeaks(bf16=756e12, fp16=756e12, tf32=378e12, fp32=51.2e12, fp8=1513e12),
    "H100 NVL": GpuPeaks(bf16=835e12, fp16=835e12, tf32=417.5e12, fp32=60e12, fp8=1670e12),
    "H800": GpuPeaks(bf16=989e12, fp16=989e12, tf32=494.7e12, fp32=66.9e12, fp8=1979e12),
    "H800 PCIE": GpuPeaks(bf16=756e12, fp16=756e12, tf32=378e12, fp32=51.2e12, fp8=1513e12),
    "H200": GpuPeaks(bf16=989e12, fp16=989e12, tf32=494.7e12, fp32=66.9e12, fp8=1979e12),
    "H200 NVL": GpuPeaks(bf16=835e12, fp16=835e12, tf32=417.5e12, fp32=60e12, fp8=1670e12),
    "GH200": GpuPeaks(bf16=989e12, fp16=989e12, tf32=494.7e12, fp32=66.9e12, fp8=1979e12),
    "H20": GpuPeaks(bf16=148e12, fp16=148e12, tf32=74e12, fp32=44e12, fp8=296e12),
    # NVIDIA Blackwell
    "B200": GpuPeaks(bf16=2.25e15, fp16=2.25e15, tf32=1.125e15, fp32=75e12, fp8=4.5e15),
    "GB200": GpuPeaks(bf16=2.5e15, fp16=2.5e15, tf32=1.25e15, fp32=80e12, fp8=5e15),
    # NVIDIA Volta (no bf16/tf32 tensor cores)
    "V100": GpuPeaks(bf16=None, fp16=125e12, tf32=None, fp32=15.7e12),
    # AMD Instinct (ROCm reports these through torch.cuda)
    "MI250X": GpuPeaks(bf16=383e12, fp16=383e12, tf32=None, fp32=95.7e12),
    "MI250": GpuPeaks(bf16=362.1e12, fp16=362.1e12, tf32=None, fp32=90.5e12),
    "MI300X": GpuPeaks(bf16=1307.4e12, fp16=1307.4e12, tf32=653.7e12, fp32=163.4e12, fp8=2614.9e12),
    "MI325X": GpuPeaks(bf16=1307.4e12, fp16=1307.4e12, tf32=653.7e12, fp32=163.4e12, fp8=2614.9e12),
    "MI355X": GpuPeaks(bf16=2.5e15, fp16=2.5e15, tf32=None, fp32=157.3e12, fp8=5e15),
}


def _name_tokens(name: str) -> set[str]:
    return {t for t in re.split(r"[^A-Z0-9]+", name.upper()) if t}


def match_gpu_name(name: str) -> str | None:
    """Return the ``GPU_PEAKS`` key for a device name, or ``None`` if unknown."""
    tokens = _name_tokens(name)
    best: str | None = None
    for key in GPU_PEAKS:
        key_tokens = _name_tokens(key)
        if key_tokens <= tokens and (best is None or len(key_tokens) > len(_name_tokens(best))):
            best = key
    return best


def tf32_enabled() -> bool:
    """Whether float32 CUDA matmuls may use TF32 tensor cores."""
    if torch.get_float32_matmul_precision() != "highest":
        return True
    return getattr(torch.backends.cuda.matmul, "fp32_precision", "none") == "tf32"


def lookup_gpu_peak(name: str, dtype: torch.dtype, allow_tf32: bool = True) -> float | None:
    """Datasheet dense peak FLOP/s for a GPU name and matmul dtype, or ``None``.

    ``torch.float32`` maps to the TF32 tensor-core peak when ``allow_tf32`` is set
    (falling back to plain FP32 on parts without TF32), else to the FP32 peak.
    """
    key = match_gpu_name(name)
    if key is None:
        return None
    peaks = GPU_PEAKS[key]
    if dtype == torch.bfloat16:
        return peaks.bf16
    if dtype == torch.float16:
        return peaks.fp16
    if dtype == torch.float32:
        if allow_tf32 and peaks.tf32 is not None:
            return peaks.tf32
        return peaks.fp32
    if dtype.is_floating_point and dtype.itemsize == 1:
        return peaks.fp8
    return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.synchronize()


@torch.no_grad()
def measure_matmul_flops(
    device: torch.device,
    dtype: torch.dtype,
    size: int,
    iters: int,
    time_budget_s: float | None = None,
) -> float:
    """Best-of-``iters`` FLOP/s of a ``size x size`` square matmul on ``device``.

    One untimed warm-up matmul runs first; with ``time_budget_s`` the timed loop stops
    early once the budget is spent (at least one timed matmul always runs). Uses a
    private RNG so the caller's random state is untouched.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=gen).to(dtype)
    b = torch.randn(size, size, device=device, generator=gen).to(dtype)
    torch.matmul(a, b)
    _synchronize(device)

    best = float("inf")
    start = time.perf_counter()
    for _ in range(max(1, iters)):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        _synchronize(device)
        best = min(best, time.perf_counter() - t0)
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            break
    del a, b
    return 2.0 * size**3 / max(best, 1e-9)


def _calibrate_cpu(dtype: torch.dtype) -> tuple[float, int]:
    """Measure CPU matmul FLOP/s, growing the size while a matmul is fast (< ~2 s)."""
    size = _CPU_MIN_SIZE
    cpu = torch.device("cpu")
    while size < _CPU_MAX_SIZE:
        seconds = 2.0 * size**3 / measure_matmul_flops(cpu, dtype, size, iters=1)
        if seconds > _CPU_GROW_BELOW_S:
            break
        size *= 2
    return measure_matmul_flops(cpu, dtype, size, iters=5, time_budget_s=_CPU_BUDGET_S), size


def cpu_model_name() -> str:
    """CPU model string from /proc/cpuinfo, falling back to ``platform``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's bf16 matmul instructions from /proc/cpuinfo (x86 ``avx512_bf16``,
    ``amx_bf16``; Arm ``bf16``); empty where it has none or the file is unreadable."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith(("flags", "features")):
                    flags = line.split(":", 1)[1].split()
                    return [x for x in ("avx512_bf16", "amx_bf16", "bf16") if x in flags]
    except OSError:
        pass
    return []


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _read_cache(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: str, key: str, entry: dict) -> None:
    """Add one entry to the JSON cache; atomic replace so readers never see half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    data = _read_cache(path)
    data[key] = entry
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def _measured_peak(
    device: torch.device,
    dtype: torch.dtype,
    cache_dir: str | None,
    description: str,
    refresh: bool = True,
) -> tuple[float, str]:
    """Measured (optionally cached) peak for a device that has no datasheet entry; a cached
    CPU rate is re-measured only with `refresh`."""
    key = f"{description}|{_dtype_name(dtype)}|torch={torch.__version__}"
    path = os.path.join(cache_dir, CACHE_FILE_NAME) if cache_dir else None
    cached = 0.0
    if path is not None:
        entry = _read_cache(path).get(key)
        if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)):
            cached = float(entry["flops"])
            if device.type != "cpu" or not refresh:
                return cached, f"cached measurement from {path} [{key}]"

    if device.type == "cpu" and cached > 0:
        # Other load only ever slows a CPU measurement, so the cache keeps the best rate seen
        # and each run re-measures briefly: one taken on a busy machine does not stick.
        size = _CPU_REFRESH_SIZE
        flops = measure_matmul_flops(device, dtype, size, iters=3, time_budget_s=0.5)
        if flops <= cached:
            now = f"{flops / 1e12:.3f} TFLOP/s now"
            return cached, f"best cached measurement from {path} [{key}] ({now})"
    elif device.type == "cpu":
        flops, size = _calibrate_cpu(dtype)
    else:
        size = _GPU_MEASURE_SIZE
        flops = measure_matmul_flops(device, dtype, size, iters=10, time_budget_s=2.0)
    source = f"measured {_dtype_name(dtype)} {size}x{size} matmul [{key}]"
    if path is not None:
        entry = {
            "flops": flops,
            "size": size,
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        }
        try:
            _write_cache(path, key, entry)
        except OSError as e:
            logger.warning("could not write peak FLOPs cache %s: %s", path, e)
    return flops, source


def device_peak_flops(
    device: torch.device, dtype: torch.dtype, cache_dir: str | None = None, refresh: bool = True
) -> tuple[float, str]:
    """Return ``(peak FLOP/s, source description)`` for matmuls in ``dtype`` on ``device``.

    CUDA/ROCm: datasheet dense peak by ``torch.cuda.get_device_name()``; unknown GPUs
    get a measured matmul rate and a warning (measured rates are below datasheet peaks,
    so MFU against them reads high). CPU: a short matmul calibration (< ~2 s), cached in
    ``<cache_dir>/peak_flops_cache.json`` keyed by CPU model, thread count, dtype and
    torch version; later runs re-measure one 1024 matmul and keep the best rate seen, only
    with ``refresh`` (the trainer: local rank 0; the host's other ranks take the cache,
    rather than measuring at once on the cores they share).
    Measuring allocates device memory; reset peak-memory stats afterwards.
    """
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        allow_tf32 = tf32_enabled()
        peak = lookup_gpu_peak(name, dtype, allow_tf32=allow_tf32)
        if peak is not None:
            label = "tf32" if dtype == torch.float32 and allow_tf32 else _dtype_name(dtype)
            return peak, f"datasheet dense {label} peak for {match_gpu_name(name)} ({name})"
        logger.warning(
            "no datasheet peak for GPU %r with %s; using a measured matmul rate, "
            "so MFU will read higher than against a datasheet peak",
            name,
            _dtype_name(dtype),
        )
        return _measured_peak(device, dtype, cache_dir, f"gpu={name}|tf32={allow_tf32}")
    if device.type == "cpu":
        description = f"cpu={cpu_model_name()}|threads={torch.get_num_threads()}"
        return _measured_peak(device, dtype, cache_dir, description, refresh)
    logger.warning("no datasheet peaks for device type %r; measuring a matmul", device.type)
    return _measured_peak(device, dtype, cache_dir, f"device={device.type}")
