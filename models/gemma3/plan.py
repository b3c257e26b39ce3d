"""What the framework needs to know to parallelize Gemma 3, as data: its tensor-parallel plan
(Qwen3's, plus the norms after attention and after the MLP) and the activation bytes one block
saves (for the estimator). The generic decoder path (`parallelisms/decoder.py`) applies them."""

from __future__ import annotations

from models.tp_plan import TPPlan, decoder_tp_plan


def gemma3_tp_plan(loss_parallel: bool) -> TPPlan:
    """The shared decoder's Megatron-style plan (vocabulary-parallel embeddings and tied
    output, column-parallel q/k/v and w1/w3, row-parallel wo and w2, the other norms on
    sequence shards), with the per-head QK-norms local to each rank's heads and Gemma's
    post-attention and post-MLP norms on sequence shards. The sqrt(dim) embedding scale is a
    Python number applied inside the sharded lookup (linear in the partial sums)."""
    return decoder_tp_plan(loss_parallel, qk_norms=True, post_norms=True)


def gemma3_block_activation_bytes(args, s: int, b: int, t: int = 1) -> float:
    """Activation bytes one Gemma 3 block saves for backward (16-bit compute, fused attention),
    counted from what autograd keeps (tests/unit/test_estimate.py measures it), per token:
    - each of the four dim-wide norms (computed in float32) its float32 input and normalised
      value and one float32 statistic (8 dim + 4), and the 16-bit inputs of the q/k/v and
      w1/w3 projections (2 x 2 dim);
    - the QK-norms the same over q (q_dim = n_heads x head_dim) and k (kv_dim = n_kv_heads x
      head_dim): 8 per element, 4 per head (RoPE, a product with a constant table, keeps
      nothing more);
    - the attention core: q, k, v at their own head counts and its output (also the output
      projection's input), and one float32 log-sum-exp per query and head; no scores;
    - the GeGLU: the w1 and w3 outputs, the gate and the product (8 ffn_dim).
    36 dim + 12 q_dim + 12 kv_dim + 8 ffn_dim + 8 n_heads + 4 n_kv_heads + 16 in all, divided
    by t under TP + sequence parallelism."""
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    norms = 4 * (8 * args.dim + 4) + 2 * 2 * args.dim
    qk_norms = 8 * (q_dim + kv_dim) + 4 * (args.n_heads + args.n_kv_heads)
    attention = 2 * (2 * q_dim + 2 * kv_dim) + 4 * args.n_heads
    per_token = norms + qk_norms + attention + 8 * args.ffn_dim
    return float(s) * b * per_token / t
