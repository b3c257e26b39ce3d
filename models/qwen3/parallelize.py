"""How Qwen3 is parallelized: its TP plan and FSDP units as data, the pipeline cut, and what it
cannot run (checked with the config). The generic parallelisms are applied in the usual order:
tensor parallel -> activation checkpointing -> compile -> data parallel (FSDP2 / ZeRO)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from parallelisms.activation_checkpoint import apply_ac
from parallelisms.compile import apply_compile
from parallelisms.data_parallel import apply_data_parallel
from parallelisms.fsdp import FsdpUnit, embed_blocks_head_units
from parallelisms.parallel_dims import ParallelDims, ParallelismError, tied_weight_problems
from parallelisms.pipeline import build_pipeline, stage_module_names
from parallelisms.tensor_parallel import TPPlan, apply_tp, check_tp


def qwen3_tp_plan(loss_parallel: bool) -> TPPlan:
    """Llama's Megatron-style plan (vocabulary-parallel embeddings and output, column-parallel
    q/k/v and w1/w3, row-parallel wo and w2, norms on sequence shards), plus the per-head
    QK-norms: their input is this rank's heads ([batch, seq, heads, head_dim], sharded on
    dim 2), each head normalised on its own, the weight replicated. The tied output weight is
    Shard(0) like the embedding's, so the two stay one tensor under TP."""
    head_norm = SequenceParallel(sequence_dim=2, use_local_output=True)
    return TPPlan(
        root={
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
        block={
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.q_norm": head_norm,
            "attention.k_norm": head_norm,
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        },
    )


def qwen3_fsdp_units(model: nn.Module) -> list[FsdpUnit]:
    """The token embeddings (first in forward), each block, then the final norm and output
    projection together (last in forward, first in backward); tied, the embeddings join that
    last unit."""
    return embed_blocks_head_units(
        model, ["tok_embeddings"], ["norm", "output"], model.args.tie_embeddings
    )


def parallelize_qwen3(
    model: nn.Module, parallel_dims: ParallelDims, job_config, device_type: str
) -> nn.Module:
    p, ac, comp = job_config.parallelism, job_config.activation_checkpoint, job_config.compile
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.dim("tp"), qwen3_tp_plan(not p.disable_loss_parallel))
        model.tie_weights()  # TP distributed the two modules' weights one by one
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)
    if comp.enable and "model" in comp.components:
        apply_compile(model)
    if parallel_dims.data_parallel_enabled:
        apply_data_parallel(model, parallel_dims, job_config, device_type, qwen3_fsdp_units)
    return model


def pipeline_qwen3(
    model: nn.Module, parallel_dims: ParallelDims, job_config, device: torch.device, loss_fn
):
    """Untied Qwen3 only (`validate_qwen3` refuses tied weights under PP): the embeddings on
    the first stage, the final norm and output on the last."""
    names = stage_module_names(
        len(model.layers), job_config.parallelism, ["tok_embeddings"], ["norm", "output"]
    )
    return build_pipeline(
        model,
        parallel_dims,
        job_config,
        device,
        loss_fn,
        names,
        lambda m: parallelize_qwen3(m, parallel_dims, job_config, device.type),
    )


def validate_qwen3(cfg, args) -> list[str]:
    """What a Qwen3 run cannot do, found from the config before any process group starts."""
    p = cfg.parallelism
    problems = []
    try:
        check_tp(args.n_heads, args.n_kv_heads, cfg.training.seq_len, p.tensor_parallel_degree)
    except ParallelismError as e:
        problems.append(str(e))
    if args.tie_embeddings:
        problems += tied_weight_problems(p, cfg.model.flavor)
    return problems


def qwen3_block_activation_bytes(args, s: int, b: int, t: int = 1) -> float:
    """Activation bytes one Qwen3 block saves for backward (16-bit compute, fused attention),
    fitted to what autograd keeps (tests/unit/test_estimate.py measures it): per token 20 dim for the
    two RMSNorms (as Llama's), 16 q_dim and 8 kv_dim for the projections, QK-norms, RoPE and
    attention (q_dim = n_heads x head_dim, kv_dim = n_kv_heads x head_dim), 8 ffn_dim for
    SwiGLU, and the per-head fp32 norm statistics (8 n_heads + 4 n_kv_heads + 8); divided by t
    under TP + sequence parallelism. For Qwen3-0.6B that is 1.62x Llama's count at its width."""
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    per_token = 20 * args.dim + 16 * q_dim + 8 * kv_dim + 8 * args.ffn_dim
    per_token += 8 * args.n_heads + 4 * args.n_kv_heads + 8
    return float(s) * b * per_token / t
