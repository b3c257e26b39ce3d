"""What the framework needs to know to parallelize Llama 3, as data: its tensor-parallel plan
and the activation bytes one block saves (for the estimator). The generic decoder path
(`parallelisms/decoder.py`) applies them; nothing here composes parallelisms."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from parallelisms.tensor_parallel import TPPlan


def llama_tp_plan(loss_parallel: bool) -> TPPlan:
    """Megatron-style TP with sequence parallelism. Token ids are replicated; each rank looks
    up its vocabulary rows and the partial embeddings are reduce-scattered into sequence
    shards. Inside a block the attention and feed-forward inputs are all-gathered along the
    sequence, the input projections split by output features (each rank holds a slice of the
    heads / hidden units) and the output projections by input features, whose partial sums are
    reduce-scattered back to sequence shards; norms run on sequence shards. With
    `loss_parallel` the logits stay vocabulary-sharded (Shard(-1)) for `loss_parallel()`."""
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
            # every rank needs all positions (the RoPE table and causal mask index the full
            # sequence); `rope` and the mask are plain replicated tensors
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
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


def llama_block_activation_bytes(args, s: int, b: int, t: int = 1) -> float:
    """Activation bytes one Llama block saves for backward (16-bit compute; attention keeps no
    scores), counted from the tensors autograd keeps: each RMSNorm its input and output in fp32
    and the 16-bit matmul input (2 x 10 h), attention q and its output (4 h), k and v at the
    key/value width kv (4 kv: grouped-query attention never repeats them), the attention's
    fp32 log-sum-exp per head (4 n_heads) and the norms' fp32 statistics (8), SwiGLU's w1 and
    w3 outputs, SiLU output and product (8 f), per token: sb(24 h + 4 kv + 8 f + 4 n_heads + 8)
    (sbh(28 + 8f/h) without grouping; Korthikanti's GPT count is 34 sbh with a 4h GeLU MLP);
    divided by t under TP + sequence parallelism. The estimator's activation figure per layer,
    in every AC mode but full."""
    kv = args.n_kv_heads * args.head_dim
    per_token = 24 * args.dim + 4 * kv + 8 * args.ffn_hidden_dim + 4 * args.n_heads + 8
    return float(s) * b * per_token / t
