"""What the framework needs to know to parallelize Gemma 3, as data: its tensor-parallel plan
(Qwen3's, plus the norms after attention and after the MLP) and the activation bytes one block
saves (for the estimator). The generic decoder path (`parallelisms/decoder.py`) applies them."""

from __future__ import annotations

from torch.distributed.tensor.parallel import SequenceParallel

from models.qwen3.plan import qwen3_tp_plan
from parallelisms.tensor_parallel import TPPlan


def gemma3_tp_plan(loss_parallel: bool) -> TPPlan:
    """Qwen3's Megatron-style plan (vocabulary-parallel embeddings and tied output, column-
    parallel q/k/v and w1/w3, row-parallel wo and w2, the per-head QK-norms local to each
    rank's heads, the other norms on sequence shards), plus Gemma's post-attention and
    post-MLP norms: they follow the row-parallel wo and w2, whose outputs are already
    reduce-scattered to sequence shards, so they run on sequence shards too and return
    plain tensors for the residual. The sqrt(dim)
    embedding scale is a Python number applied inside the sharded lookup (linear in the
    partial sums)."""
    plan = qwen3_tp_plan(loss_parallel)
    block = dict(plan.block)
    # local outputs: the residual they join is this rank's plain sequence shard
    post_norm = SequenceParallel(use_local_output=True)
    block["post_attention_norm"] = post_norm
    block["post_ffn_norm"] = post_norm
    return TPPlan(root=plan.root, block=block)


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
