"""Mixed-precision policy: the one place that turns `training.mixed_precision_param` /
`mixed_precision_reduce` into dtypes, for the trainer, the data-parallel wrappers, the
estimator and the benchmarks alike."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def mixed_precision_dtypes(training_cfg, device_type: str) -> tuple[torch.dtype, torch.dtype]:
    """(param/compute dtype, gradient-reduction dtype); `auto` = bf16 on CUDA, fp32 on CPU:
    CPUs without bf16 instructions run bf16 matmuls far slower than fp32, and fp32 keeps CPU
    runs comparable across layouts (CPUs with `avx512_bf16`/`amx_bf16` train faster in bf16,
    `--training.mixed_precision_param bfloat16`)."""
    param = training_cfg.mixed_precision_param
    if param == "auto":
        param = "bfloat16" if device_type == "cuda" else "float32"
    return DTYPES[param], DTYPES[training_cfg.mixed_precision_reduce]
