"""What the framework needs to know to parallelize Qwen3, as data: its tensor-parallel plan
(Llama's plus the per-head QK-norms) and the activation bytes one block saves (for the
estimator). The generic decoder path (`parallelisms/decoder.py`) applies them."""

from __future__ import annotations

from models.tp_plan import TPPlan, decoder_tp_plan


def qwen3_tp_plan(loss_parallel: bool) -> TPPlan:
    """The shared decoder's Megatron-style plan (vocabulary-parallel embeddings and output,
    column-parallel q/k/v and w1/w3, row-parallel wo and w2, norms on sequence shards), plus
    the per-head QK-norms, local to each rank's heads. The tied output weight is Shard(0)
    like the embedding's, so the two stay one tensor under TP."""
    return decoder_tp_plan(loss_parallel, qk_norms=True)


def qwen3_block_activation_bytes(args, s: int, b: int, t: int = 1) -> float:
    """Activation bytes one Qwen3 block saves for backward (16-bit compute, no attention scores),
    fitted to what autograd keeps (tests/unit/test_estimate.py measures it): per token 20 dim for the
    two RMSNorms (as Llama's), 16 q_dim and 8 kv_dim for the projections, QK-norms, RoPE and
    attention (q_dim = n_heads x head_dim, kv_dim = n_kv_heads x head_dim), 8 ffn_dim for
    SwiGLU, and the per-head fp32 norm statistics (8 n_heads + 4 n_kv_heads + 8); divided by t
    under TP + sequence parallelism. For Qwen3-0.6B that is 1.62x Llama's count at its width."""
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    per_token = 20 * args.dim + 16 * q_dim + 8 * kv_dim + 8 * args.ffn_dim
    per_token += 8 * args.n_heads + 4 * args.n_kv_heads + 8
    return float(s) * b * per_token / t
