"""How Llama 3 is parallelized: tensor parallel -> activation checkpointing -> compile ->
data parallel (FSDP2 / ZeRO). Works on the whole model or on one pipeline stage of it."""

from __future__ import annotations

from torch import nn

from parallelisms.activation_checkpoint import apply_ac
from parallelisms.compile import apply_compile
from parallelisms.fsdp import apply_data_parallel
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import apply_tp


def parallelize_llama(
    model: nn.Module, parallel_dims: ParallelDims, job_config, device_type: str
) -> nn.Module:
    p, ac, comp = job_config.parallelism, job_config.activation_checkpoint, job_config.compile
    if parallel_dims.tp_enabled:
        # First: TP turns the weights into tp-sharded DTensors, which FSDP then shards on dp,
        # and its collectives belong inside the blocks that AC recomputes and compile traces.
        apply_tp(model, parallel_dims.dim("tp"), loss_parallel=not p.disable_loss_parallel)
    if ac.mode != "none":
        # Before compile, so each compiled block graph contains its checkpointing policy.
        apply_ac(model, ac.mode, ac.selective_ac_option)
    if comp.enable and "model" in comp.components:
        # Before data parallelism, so FSDP/ZeRO hooks run around the compiled blocks, not in them.
        apply_compile(model)
    if parallel_dims.dp_enabled:
        # Last: FSDP wraps the final block modules (its units) and shards whatever TP made.
        apply_data_parallel(model, parallel_dims, job_config, device_type)
    return model
