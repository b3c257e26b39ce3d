"""Activation checkpointing (AC): trade recomputation in backward for activation memory.

Modes: "full" recomputes every transformer block; "selective" with an integer N recomputes
every N-th block (blocks N-1, 2N-1, ... stay whole otherwise); "selective" with "op" wraps
every block but saves the outputs of matmuls, attention and collectives, recomputing only
the cheap elementwise ops (norms, SiLU, RoPE, residual adds).

Blocks are wrapped with `checkpoint_wrapper` (the `model.layers` keys stay). `state_dict()`
and DCP's `get_model_state_dict` drop the wrapper's `_checkpoint_wrapped_module.` prefix, so
checkpoint keys are the plain FQNs; `named_parameters()` still shows it, and
`models.init_weights.canonical_name` strips it where raw names are used.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

import models.block_attention  # noqa: F401  (registers torch.ops.meshtrain.block_attention)
from models import mtp

_aten = torch.ops.aten
_SAVE_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
# Ops whose outputs selective AC saves: the expensive ones (attention's block-mask kernel and
# FlexAttention included), and the TP and CP collectives (recomputing those would repeat
# communication: CP's K/V all-gather, Ulysses' all-to-alls).
SAVE_OPS = {getattr(_aten, n).default for n in _SAVE_OP_NAMES if hasattr(_aten, n)}
SAVE_OPS.add(torch.ops.meshtrain.block_attention.default)
if hasattr(torch.ops.higher_order, "flex_attention"):
    SAVE_OPS.add(torch.ops.higher_order.flex_attention)
for _name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce", "all_to_all_single"):
    if hasattr(torch.ops._c10d_functional, _name):
        SAVE_OPS.add(getattr(torch.ops._c10d_functional, _name).default)


# Profiler range markers (`record_function`) carry no tensors, yet selective AC numbers every
# op it sees, per op, in forward and again in the recompute, and fails on an invocation the
# forward did not have. An FSDP unit nested in a checkpointed block (the expert-parallel
# experts) opens one range more in the recompute: run in backward, its pre-forward hook finds
# no forward root and opens "FSDP::root_pre_forward". Left out of the count, as torch leaves
# out `detach`, they run as they are in both passes.
_profiler = torch.ops.profiler
PROFILER_RANGE_OPS = {
    getattr(packet, overload)
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
    if (packet := getattr(_profiler, name, None)) is not None
    for overload in packet.overloads()
}


# The policy below as a string: the ops it saves (all else is recomputed).
POLICY_HASH = "meshtrain per-op AC saves " + ",".join(sorted(str(op) for op in SAVE_OPS))


def _op_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    if func in SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _draws_random_numbers(block: nn.Module) -> bool:
    """True when the block has active dropout: its recomputation must replay the RNG state."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in block.modules())


def _wrap(block: nn.Module, per_op: bool) -> nn.Module:
    # Saving and restoring the RNG state costs a device sync per block; a block without
    # dropout draws no random numbers, so there is nothing to replay.
    kwargs = {"preserve_rng_state": _draws_random_numbers(block)}
    if per_op:
        SAC_IGNORED_OPS.update(PROFILER_RANGE_OPS)
        context_fn = partial(create_selective_checkpoint_contexts, _op_policy)
        # What AOT autograd's compile cache keys the policy by: without it a compiled block
        # under per-op AC is never cached ("SAC context_fn does not have a cache_hash").
        context_fn.cache_hash = POLICY_HASH
        kwargs["context_fn"] = context_fn
    return checkpoint_wrapper(block, **kwargs)


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str = "2") -> nn.Module:
    """Wraps `model.layers` entries in place (keys unchanged) according to `mode`, and the
    blocks of multi-token-prediction modules as the layers after them."""
    if mode == "none":
        return model
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpoint.mode = '{mode}': expected none/full/selective")
    per_op = mode == "selective" and selective_ac_option == "op"
    every = 1
    if mode == "selective" and not per_op:
        every = int(selective_ac_option)
        if every < 1:
            raise ValueError(f"selective_ac_option = {selective_ac_option}: must be 'op' or >= 1")
    for i, (name, block) in enumerate(list(model.layers.items())):
        # The global layer index (the ModuleDict key), so pipeline stages pick the same blocks.
        index = int(name) if name.isdigit() else i
        if (index + 1) % every == 0:
            model.layers[name] = _wrap(block, per_op)
    # multi-token-prediction modules (models/mtp.py; no PP): module k's block as layer n + k
    for k, module in enumerate(mtp.modules(model)):
        if (len(model.layers) + k + 1) % every == 0:
            module.block = _wrap(module.block, per_op)
    return model
