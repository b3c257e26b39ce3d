"""How Qwen3-MoE is parallelized: expert parallelism for the experts, Qwen3's TP plan for
attention, the routing statistics summed over the data-parallel ranks, FSDP units (the experts
of each block their own unit under EP; under ZeRO 0-2 their own `apply_zero`), the pipeline
cut, and what it cannot run.

Order: expert parallel -> tensor parallel -> activation checkpointing -> compile -> FSDP2 or
ZeRO 0-2 (the experts first).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from models.qwen3.parallelize import qwen3_tp_plan, validate_qwen3
from models.qwen3_moe.routing import moe_layers
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.compile import apply_compile
from parallelisms.data_parallel import apply_data_parallel, apply_expert_zero
from parallelisms.expert_parallel import apply_ep, replicate_experts
from parallelisms.fsdp import FsdpUnit, embed_blocks_head_units, fsdp_mesh
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import build_pipeline, stage_module_names
from parallelisms.tensor_parallel import ReplicateParallel, TPPlan, apply_tp

EXPERT_WEIGHTS = ("w1", "w2", "w3")
logger = logging.getLogger("meshtrain")


def qwen3_moe_tp_plan(loss_parallel: bool) -> TPPlan:
    """Qwen3's plan for embeddings, attention and output. The MoE layer takes the whole
    sequence (all-gathered, like the dense feed-forward's input) and returns it to sequence
    shards: every TP rank routes the same tokens with a replicated router, and runs the experts
    it holds (all of them, or its EP share) on them; no expert weight is split over TP."""
    dense = qwen3_tp_plan(loss_parallel)
    block = {k: v for k, v in dense.block.items() if not k.startswith("feed_forward")}
    block["moe"] = PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(Shard(1),),
        use_local_output=True,
    )
    block["moe.router"] = ReplicateParallel()
    return TPPlan(root=dense.root, block=block)


def qwen3_moe_fsdp_units(model: nn.Module, parallel_dims: ParallelDims) -> list[FsdpUnit]:
    """Qwen3's units; under EP each block's experts first, sharded over the ranks outside EP,
    their reduced gradients divided by the whole DP x CP degree (they sum the EP group's
    tokens; the dense weights' gradients are averaged over the DP and CP ranks)."""
    units = embed_blocks_head_units(
        model, ["tok_embeddings"], ["norm", "output"], model.args.tie_embeddings
    )
    if not parallel_dims.ep_enabled:
        return units
    mesh = fsdp_mesh(parallel_dims, "dp_shard_mod_ep")
    divide = parallel_dims.dp * parallel_dims.cp
    experts = [
        FsdpUnit([moe.experts], "experts", mesh=mesh, gradient_divide_factor=divide)
        for moe in moe_layers([model]).values()
    ]
    return experts + units


def _sum_over(group):
    def reduce(stats: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        return stats

    return reduce


def parallelize_qwen3_moe(
    model: nn.Module, parallel_dims: ParallelDims, job_config, device_type: str
) -> nn.Module:
    p, ac, comp = job_config.parallelism, job_config.activation_checkpoint, job_config.compile
    layers = moe_layers([model])
    if parallel_dims.data_parallel_enabled:
        # The load-balancing statistics are those of the global micro-batch (all its
        # sequences, all their CP shards).
        reduce = _sum_over(parallel_dims.dim("dp_cp").get_group())
        for moe in layers.values():
            moe.reduce_stats = reduce
    if parallel_dims.ep_enabled:
        # First: the experts become "ep"-sharded DTensors, which FSDP then shards further.
        for moe in layers.values():
            apply_ep(moe.experts, parallel_dims.dim("ep"), EXPERT_WEIGHTS)
    if parallel_dims.tp_enabled:
        if not parallel_dims.ep_enabled:
            for moe in layers.values():
                replicate_experts(moe.experts, parallel_dims.dim("tp"), EXPERT_WEIGHTS)
        apply_tp(model, parallel_dims.dim("tp"), qwen3_moe_tp_plan(not p.disable_loss_parallel))
        model.tie_weights()
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)
    if comp.enable and "model" in comp.components:
        # attention only: routing has data-dependent shapes (expert counts, EP splits)
        apply_compile(model, "attention")
    if parallel_dims.ep_enabled and parallel_dims.zero_stage < 3:  # experts first (own meshes)
        for moe in layers.values():
            apply_expert_zero(moe.experts, parallel_dims, job_config, device_type)
    if parallel_dims.data_parallel_enabled:
        units = functools.partial(qwen3_moe_fsdp_units, parallel_dims=parallel_dims)
        apply_data_parallel(model, parallel_dims, job_config, device_type, units)
    return model


def pipeline_qwen3_moe(
    model: nn.Module, parallel_dims: ParallelDims, job_config, device: torch.device, loss_fn
):
    names = stage_module_names(
        len(model.layers), job_config.parallelism, ["tok_embeddings"], ["norm", "output"]
    )
    parts, schedule, first, last = build_pipeline(
        model,
        parallel_dims,
        job_config,
        device,
        loss_fn,
        names,
        lambda m: parallelize_qwen3_moe(m, parallel_dims, job_config, device.type),
    )
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    for stage in stages:
        _uncounted_metadata_forward(stage)
    return parts, schedule, first, last


_METADATA_FORWARDS = ("_forward_metadata_inference", "_shape_inference")


def _uncounted_metadata_forward(stage) -> None:
    """torch's pipeline stages run one extra forward on the first step to learn the shapes
    they exchange (on placeholder inputs); its routing must not count as the step's. Wraps
    that method (its name differs across torch versions) so the stage's MoE layers skip it."""
    name = next((n for n in _METADATA_FORWARDS if hasattr(stage, n)), None)
    if name is None:
        logger.warning(
            "MoE + pipeline: this torch's stages have none of %s; if they run a shape-inference "
            "forward, its routing counts toward the first step's balancing statistics",
            ", ".join(_METADATA_FORWARDS),
        )
        return
    infer, layers = getattr(stage, name), moe_layers([stage.submod]).values()

    def uncounted(*args, **kwargs):
        for moe in layers:
            moe.counting = False
        try:
            return infer(*args, **kwargs)
        finally:
            for moe in layers:
                moe.counting = True

    setattr(stage, name, uncounted)


def validate_qwen3_moe(cfg, args) -> list[str]:
    """What a Qwen3-MoE run cannot do, found from the config before any process group starts:
    Qwen3's checks (TP over the heads, tied weights), and EP over the experts."""
    problems = validate_qwen3(cfg, args)
    ep = cfg.parallelism.expert_parallel_degree
    if args.n_experts % ep:
        problems.append(
            f"parallelism.expert_parallel_degree = {ep} must divide the {args.n_experts} "
            f"experts of model.flavor = '{cfg.model.flavor}'."
        )
    return problems


def qwen3_moe_block_activation_bytes(args, s: int, b: int, t: int = 1) -> float:
    """Activation bytes one Qwen3-MoE block saves for backward (16-bit compute): Qwen3's
    attention part (20 dim for the norms, 16 q_dim + 8 kv_dim, the per-head norm statistics),
    divided by t under TP + SP, plus the MoE layer on the whole sequence (TP ranks share its
    tokens): per token the router's fp32 logits and scores (8 E), the k copies of the input
    gathered for the experts (2 k dim) and per copy SwiGLU's saved tensors (8 moe_ffn_dim) and
    output (2 dim)."""
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attention = 20 * args.dim + 16 * q_dim + 8 * kv_dim + 8 * args.n_heads + 4 * args.n_kv_heads
    moe = 8 * args.n_experts + args.top_k * (4 * args.dim + 8 * args.moe_ffn_dim)
    return float(s) * b * (attention / t + moe)
