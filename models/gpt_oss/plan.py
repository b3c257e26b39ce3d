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
    """Activation bytes one gpt-oss block saves for backward (16-bit compute), per token as
    autograd saves them on CPU (fitted over 13 shapes of the debug model, within 16 bytes):
    the two norms and their outputs (20 dim), q and k in fp32 for RoPE and q, k, v in bf16 for
    the core (6 q_dim + 4 kv_dim), the log-sum-exp and the sinks' scale (8 per head), divided by
    t under TP + SP; plus the MoE layer on the whole sequence: the router's fp32 logits (4 E)
    and per chosen copy of the token its input (2 dim), its output (2 dim), the fused
    projection's output, the clamped gate and up, the sigmoid, the products and the
    activation (14 F), and its indices and weight (38)."""
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attention = 20 * args.dim + 6 * q_dim + 4 * kv_dim + 8 * args.n_heads
    moe = 4 * args.n_experts + args.top_k * (4 * args.dim + 14 * args.moe_ffn_dim + 38)
    return float(s) * b * (attention / t + moe)
