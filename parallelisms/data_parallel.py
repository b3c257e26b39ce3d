"""Data parallelism: which ZeRO stage a run gets, and the call that applies it.

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
           (HSDP on the 2-D (dp_replicate, dp_shard) mesh: N = dp_shard; with replicas
           only, dp_shard = 1, FSDP2 shards over one rank and all-reduces over the replicas:
           DDP's memory; a tied parameter stays in one unit, as it stays one master in 0-2)

N counts the CP ranks too (they average gradients like data ranks); under TP, Psi is the
rank's TP shard, which stages 1-3 split over the N data-parallel ranks.

Why stages 1-2 are not FSDP2 with resharding disabled: FSDP2 always keeps its sharded
parameter *and* the all-gathered unsharded one, so `reshard_after_forward=False` +
`set_reshard_after_backward(False)` holds 4 Psi + 4 Psi / N of parameters; in fp32 the extra
shard is a redundant copy (with bf16 it plays the paper's fp32 master weights, which
`apply_zero` keeps too). `apply_zero` makes the shard a view into the full parameter instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from models.mixed_precision import mixed_precision_dtypes
from parallelisms.fsdp import FsdpUnit, apply_fsdp, fsdp_mesh
from parallelisms.parallel_dims import ParallelDims
from parallelisms.zero import apply_zero

if TYPE_CHECKING:
    from job_config.schema import Parallelism, Training


def apply_data_parallel(
    model: nn.Module,
    parallel_dims: ParallelDims,
    t: Training,
    p: Parallelism,
    device_type: str,
    fsdp_units: Callable[[nn.Module], list[FsdpUnit]],
) -> nn.Module:
    """Applies `parallelism.zero_stage` over the data-parallel mesh (see the module doc) with
    the `[training]` section's precision and offload; `fsdp_units(model)` gives the family's
    FSDP units for stage 3."""
    param_dtype, reduce_dtype = mixed_precision_dtypes(t, device_type)
    stage = parallel_dims.zero_stage
    if stage == 3:
        return apply_fsdp(
            model,
            fsdp_mesh(parallel_dims),
            fsdp_units(model),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=p.fsdp_reshard_after_forward,
            cpu_offload=t.enable_cpu_offload,
            pp_enabled=parallel_dims.pp_enabled,
            pin_memory=device_type == "cuda",
        )
    # CP ranks hold other tokens of the same sequences: their gradients are averaged (and
    # ZeRO-1/2 shards spread) over them as over the data-parallel ranks
    dp = parallel_dims.dim_name("dp_cp")
    return apply_zero(
        model,
        parallel_dims.mesh[dp],
        stage,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        # under TP the masters of TP shards live on (dp, tp) (FSDP2's layout over TP)
        dp_tp_mesh=parallel_dims.mesh[(dp, "tp")] if parallel_dims.tp_enabled else None,
    )


def apply_expert_zero(
    experts: nn.Module, parallel_dims: ParallelDims, t: Training, device_type: str
) -> nn.Module:
    """ZeRO stages 0-2 for expert-parallel experts (DTensors on "ep", from `apply_ep`), applied
    before `apply_data_parallel`: replicated over the ranks outside EP ("dp_shard_mod_ep"),
    their gradients averaged there but divided by the whole DP x CP degree (they hold the sum
    over the EP group's tokens), stages 1-2 splitting each rank's experts over those ranks
    (masters on ("dp_shard_mod_ep", "ep"), FSDP2's layout of the experts)."""
    param_dtype, reduce_dtype = mixed_precision_dtypes(t, device_type)
    mesh = parallel_dims.mesh
    return apply_zero(
        experts,
        mesh["dp_shard_mod_ep"],
        parallel_dims.zero_stage,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        dp_tp_mesh=mesh[("dp_shard_mod_ep", "ep")],
        divide_by=parallel_dims.dp * parallel_dims.cp,
    )
