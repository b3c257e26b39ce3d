"""What the framework needs to know to parallelize Qwen3-MoE, as data: its tensor-parallel plan
(Qwen3's for attention; the MoE layer on the whole sequence) and the activation bytes one block
saves. Where the experts are and how routing statistics are reduced is in models/moe_routing.py;
the generic decoder path (`parallelisms/decoder.py`)
applies expert parallelism, TP, AC, compile and data parallelism from them."""

from __future__ import annotations

from models.tp_plan import TPPlan, decoder_tp_plan, moe_block_plan


def qwen3_moe_tp_plan(loss_parallel: bool) -> TPPlan:
    """The shared decoder's plan with Qwen3's per-head QK-norms for embeddings, attention and
    output, and the MoE layer on the whole sequence (`models.tp_plan.moe_block_plan`)."""
    return moe_block_plan(decoder_tp_plan(loss_parallel, qk_norms=True))


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
