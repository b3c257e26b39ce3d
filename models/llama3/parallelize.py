"""How Llama 3 is parallelized: the order is TP -> activation checkpointing -> compile -> FSDP."""

from __future__ import annotations

from torch import nn

from parallelisms.fsdp import apply_fsdp, mixed_precision_dtypes
from parallelisms.parallel_dims import ParallelDims


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config, device_type: str):
    if parallel_dims.dp_enabled:
        param_dtype, reduce_dtype = mixed_precision_dtypes(job_config.training, device_type)
        apply_fsdp(
            model,
            parallel_dims.dim("dp"),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
            cpu_offload=job_config.training.enable_cpu_offload,
        )
    return model
