"""What the framework needs to know to parallelize Gemma 2, as data: its tensor-parallel plan
(Llama's plus the norms after attention and the MLP) and the activation bytes one block saves
(for the estimator). The generic decoder path (`parallelisms/decoder.py`) applies them."""

from __future__ import annotations

from models.tp_plan import TPPlan, decoder_tp_plan


def gemma2_tp_plan(loss_parallel: bool) -> TPPlan:
    """The shared decoder's Megatron-style plan (vocabulary-parallel embeddings and output,
    column-parallel q/k/v and w1/w3, row-parallel wo and w2, the pre-norms on sequence
    shards), plus the post-attention and post-MLP norms, also on sequence shards. The
    embedding scale and the final soft-cap are elementwise, so the embedding and output
    modules keep the shared styles."""
    return decoder_tp_plan(loss_parallel, post_norms=True)


def gemma2_block_activation_bytes(args, s: int, b: int, t: int = 1) -> float:
    """Activation bytes one Gemma 2 block saves for backward (16-bit compute, the attention
    core keeping q, k, v at their own head counts, its output and one float32 log-sum-exp per
    query and head, no scores), counted from the tensors autograd keeps
    (tests/unit/test_estimate.py measures it). Per token: each of the four RMSNorms its
    float32 input and normalised value (8 dim) and float32 1/rms (4), the two pre-norms their
    16-bit output (2 dim each, the q/k/v and w1/w3 input); the rotated q and k, v (RoPE
    multiplies by constant tables: it saves nothing more) and the attention output, which wo
    reads as it is (4 q_dim + 4 kv_dim, q_dim = n_heads x head_dim, kv_dim = n_kv_heads x
    head_dim), the
    log-sum-exp (4 n_heads) and the positions the mask reads (8); GeGLU's w1 and w3 outputs,
    gelu output and product (8 ffn_dim). Divided by t under TP + sequence parallelism."""
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    per_token = 36 * args.dim + 4 * q_dim + 4 * kv_dim + 8 * args.ffn_dim
    per_token += 4 * args.n_heads + 4 * 4 + 8
    return float(s) * b * per_token / t
