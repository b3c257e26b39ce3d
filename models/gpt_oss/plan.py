"""What the framework needs to know to parallelize gpt-oss, as data: its tensor-parallel plan
(the shared decoder's attention with biases, the sink logits sharded with the heads; the MoE
layer on the whole sequence) and the activation bytes one block saves. Where the experts are
and how routing statistics are reduced is models/moe_routing.py."""

from __future__ import annotations

from models.tp_plan import TPPlan, decoder_tp_plan, moe_block_plan


def gpt_oss_tp_plan(loss_parallel: bool) -> TPPlan:
    """ColwiseParallel q/k/v (their biases split with the heads), RowwiseParallel o (its bias
    replicated, added once), the sinks with the heads; the MoE layer as Qwen3-MoE's."""
    return moe_block_plan(decoder_tp_plan(loss_parallel, sinks=True))


def gpt_oss_block_activation_bytes(args, s: int, b: int, t: int = 1) -> float:
    """Activation bytes one gpt-oss block saves for backward (16-bit compute): the attention
    part as Qwen3's without the QK-norms (20 dim for the norms, 16 q_dim + 8 kv_dim) plus the
    sinks (the output before the sink scale, 2 q_dim, and the fp32 log-sum-exp, 4 heads),
    divided by t under TP + SP, plus the MoE layer on the whole sequence: per token the
    router's fp32 logits and scores (8 E), the k copies of the input (2 k dim) and per copy
    the fused projection's output (4 F), the clamped gate and up with its sigmoid (6 F), the
    activation (2 F) and the output (2 dim)."""
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attention = 20 * args.dim + 18 * q_dim + 8 * kv_dim + 4 * args.n_heads
    moe = 8 * args.n_experts + args.top_k * (4 * args.dim + 12 * args.moe_ffn_dim)
    return float(s) * b * (attention / t + moe)
