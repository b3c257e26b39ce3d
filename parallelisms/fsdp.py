"""FSDP2 (`fully_shard`) over the data-parallel mesh: ZeRO-3 with per-block wrapping."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def mixed_precision_dtypes(training_cfg, device_type: str) -> tuple[torch.dtype, torch.dtype]:
    """(param/compute dtype, gradient-reduction dtype); `auto` = bf16 on CUDA, fp32 on CPU,
    whose bf16 matmuls are far slower than fp32 on CPUs without bf16 units."""
    param = training_cfg.mixed_precision_param
    if param == "auto":
        param = "bfloat16" if device_type == "cuda" else "float32"
    return _DTYPES[param], _DTYPES[training_cfg.mixed_precision_reduce]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
) -> nn.Module:
    """Shards each transformer block, then the root (embeddings, final norm, output).

    Per-block wrapping keeps each all-gather one block wide so it overlaps the previous
    block's compute. `reshard_after_forward`: "always" frees gathered weights after forward
    (re-gathered in backward), "never" keeps them (ZeRO-2-like memory for speed), "default"
    frees them except for the last block, whose backward starts right away.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = {"mesh": dp_mesh, "mp_policy": mp}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        if reshard_after_forward == "default":
            reshard = i < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **kwargs)
    return model
