"""Mixed-precision policy: the one place that turns `training.mixed_precision_param` /
`mixed_precision_reduce` into dtypes, for the trainer, the data-parallel wrappers, the
estimator and the benchmarks alike.

Three dtypes make a run's precision: the *weights* (the parameters the optimizer updates,
their gradients and the optimizer state: the master weights), the *compute* dtype the forward
and backward run in (FSDP/ZeRO cast the weights to it, autocast where no data-parallel wrapper
does), and the *reduction* dtype the data-parallel gradient reduction runs in.

- float32 / bfloat16 compute: float32 weights (bf16 compute keeps fp32 master weights).
- float64, the exact-arithmetic parity mode: the weights themselves are float64 (cast on the
  meta device, before any parallelism sees them), so compute, gradients, optimizer state,
  pipeline stage hand-offs, CP/EP/TP communication and checkpoints are float64 too; no cast,
  no autocast. The reduction follows (`auto`). See docs/parity.md.
"""

from __future__ import annotations

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def weight_dtype(training_cfg) -> torch.dtype:
    """The dtype the model's parameters are held in: float64 in the float64 mode, else float32
    (mixed precision casts copies of float32 master weights)."""
    return torch.float64 if training_cfg.mixed_precision_param == "float64" else torch.float32


def in_weight_dtype(model: nn.Module, training_cfg) -> nn.Module:
    """`model` (on the meta device: a cast allocates nothing) with its floating-point
    parameters and buffers in `weight_dtype`; untouched in float32."""
    dtype = weight_dtype(training_cfg)
    return model if dtype == torch.float32 else model.to(dtype)


def mixed_precision_dtypes(training_cfg, device_type: str) -> tuple[torch.dtype, torch.dtype]:
    """(param/compute dtype, gradient-reduction dtype); `auto` = bf16 on CUDA, fp32 on CPU:
    CPUs without bf16 instructions run bf16 matmuls far slower than fp32, and fp32 keeps CPU
    runs comparable across layouts (CPUs with `avx512_bf16`/`amx_bf16` train faster in bf16,
    `--training.mixed_precision_param bfloat16`). The reduction's `auto` follows the weights:
    float64 in the float64 mode, else float32."""
    param = training_cfg.mixed_precision_param
    if param == "auto":
        param = "bfloat16" if device_type == "cuda" else "float32"
    reduce = training_cfg.mixed_precision_reduce
    if reduce == "auto":
        reduce = "float64" if param == "float64" else "float32"
    return DTYPES[param], DTYPES[reduce]
