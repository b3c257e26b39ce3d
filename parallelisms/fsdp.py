"""Data parallelism: FSDP2 (`fully_shard`, ZeRO-3, also HSDP) and the ZeRO stage dispatch.

How each `parallelism.zero_stage` holds memory (fp32, Psi parameters, N data-parallel ranks,
Adam; bytes per rank after a step):

  stage 0  `apply_zero(stage=0)`  DDP: full params, full all-reduced grads, full Adam state
           = 4 Psi + 4 Psi + 8 Psi
  stage 1  `apply_zero(stage=1)`  full params and full all-reduced grads; the optimizer sees
           `Shard(0)` DTensor views of the params and grads, so Adam state is 1/N
           = 4 Psi + 4 Psi + 8 Psi / N
  stage 2  `apply_zero(stage=2)`  full params; each grad is reduce-scattered as backward
           produces it and only the shard is kept = 4 Psi + (4 + 8) Psi / N
  stage 3  `fully_shard` below    params, grads and Adam state all sharded = 16 Psi / N
           (HSDP on the 2-D (dp_replicate, dp_shard) mesh: N = dp_shard; replicas only,
           i.e. dp_shard = 1, is plain DDP = stage 0)

Why stages 1-2 are not FSDP2 with resharding disabled: FSDP2 always keeps its sharded
parameter *and* the all-gathered unsharded one, so `reshard_after_forward=False` +
`set_reshard_after_backward(False)` holds 4 Psi + 4 Psi / N of parameters; in fp32 the extra
shard is a redundant copy (with bf16 it plays the paper's fp32 master weights, which
`apply_zero` keeps too). `apply_zero` makes the shard a view into the full parameter instead.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from parallelisms.parallel_dims import ParallelDims
from parallelisms.zero import apply_zero

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def mixed_precision_dtypes(training_cfg, device_type: str) -> tuple[torch.dtype, torch.dtype]:
    """(param/compute dtype, gradient-reduction dtype); `auto` = bf16 on CUDA, fp32 on CPU:
    CPUs without bf16 instructions run bf16 matmuls far slower than fp32, and fp32 keeps CPU
    runs comparable across layouts (CPUs with `avx512_bf16`/`amx_bf16` train faster in bf16,
    `--training.mixed_precision_param bfloat16`)."""
    param = training_cfg.mixed_precision_param
    if param == "auto":
        param = "bfloat16" if device_type == "cuda" else "float32"
    return _DTYPES[param], _DTYPES[training_cfg.mixed_precision_reduce]


def fsdp_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP shards over: 2-D ("dp_replicate", "dp_shard") for HSDP, else 1-D."""
    names = parallel_dims.mesh.mesh_dim_names or ()
    dp_names = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
    return parallel_dims.mesh[dp_names]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
    pp_enabled: bool = False,
    pin_memory: bool = True,
) -> nn.Module:
    """ZeRO-3: shards the embeddings, each transformer block and the final norm + output as
    separate units, then the root.

    Per-block wrapping keeps each all-gather one block wide so it overlaps the previous
    block's compute. `reshard_after_forward`: "always" frees gathered weights after forward
    (re-gathered in backward), "never" keeps them until backward (no re-gather, more memory),
    "default" frees them except for the last block, whose backward starts right away, and
    never under pipeline parallelism, whose schedules run many forwards before backwards.
    On a 2-D mesh this is HSDP: shard over "dp_shard", replicate (all-reduce) over
    "dp_replicate".
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = {"mesh": dp_mesh, "mp_policy": mp}
    if cpu_offload:
        # Pinned host memory makes the host<->GPU copies async; it needs an accelerator.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    default = reshard_after_forward == "default"
    always = reshard_after_forward == "always"
    # The token embeddings are used first in forward and last in backward: their own unit,
    # freed after forward, so a large vocabulary is not held gathered through the whole step;
    # and never gathered again: an embedding's backward needs the indices and the output
    # gradient, not the weight (FSDP reduce-scatters its gradient at the end of backward).
    if getattr(model, "tok_embeddings", None) is not None:
        # nn.Embedding returns a view of its gather; FSDP2 warns that an in-place op on it
        # would skip the pre-backward all-gather. The blocks only add to it out of place (the
        # FSDP parity tests check the gradients), so the warning would be noise in every log.
        warnings.filterwarnings(
            "ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor"
        )
        fully_shard(
            model.tok_embeddings,
            reshard_after_forward=always or (default and not pp_enabled),
            **kwargs,
        )
        model.tok_embeddings.set_unshard_in_backward(False)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        reshard = always or (default and not pp_enabled and i < len(blocks) - 1)
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # Final norm and output projection are used last in forward and first in backward: one
    # unit kept gathered between the two (no re-gather), freed after its backward.
    head = [
        m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None
    ]
    if head:
        fully_shard(head, reshard_after_forward=always, **kwargs)
    # The root holds no parameters of its own now; it runs FSDP's lazy init and waits for the
    # last reduce-scatters at the end of backward.
    fully_shard(model, reshard_after_forward=always, **kwargs)
    return model


def apply_data_parallel(
    model: nn.Module, parallel_dims: ParallelDims, job_config, device_type: str
) -> nn.Module:
    """Applies `parallelism.zero_stage` over the data-parallel mesh (see the module doc)."""
    t, p = job_config.training, job_config.parallelism
    param_dtype, reduce_dtype = mixed_precision_dtypes(t, device_type)
    stage = parallel_dims.zero_stage
    if parallel_dims.dp_shard == 1:  # only replicas (dp_replicate > 1): nothing to shard
        stage = 0
    if stage == 3:
        return apply_fsdp(
            model,
            fsdp_mesh(parallel_dims),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=p.fsdp_reshard_after_forward,
            cpu_offload=t.enable_cpu_offload,
            pp_enabled=parallel_dims.pp_enabled,
            pin_memory=device_type == "cuda",
        )
    return apply_zero(
        model,
        parallel_dims.dim("dp"),
        stage,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
    )
