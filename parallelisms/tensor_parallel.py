"""Tensor parallelism with sequence parallelism (Megatron-style), after torchtitan's Llama plan.

Inside a block, the attention and feed-forward inputs are all-gathered along the sequence
(`PrepareModuleInput` Shard(1) -> Replicate), the input projections are split by output
features (colwise: each rank holds a slice of the heads / hidden units), and the output
projections by input features (rowwise), whose partial sums are reduce-scattered back to
sequence shards. Norms and residual adds run on sequence shards (`SequenceParallel`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from parallelisms.parallel_dims import ParallelismError


def check_tp(n_heads: int, n_kv_heads: int, seq_len: int, tp: int) -> None:
    """Fails early (before process groups) when heads or sequence do not split over `tp`."""
    if tp <= 1:
        return
    problems = []
    if n_heads % tp:
        problems.append(f"n_heads = {n_heads}")
    if n_kv_heads % tp:
        problems.append(f"n_kv_heads = {n_kv_heads}")
    if seq_len % tp:
        problems.append(f"training.seq_len = {seq_len} (sequence parallelism splits it)")
    if problems:
        raise ParallelismError(
            f"parallelism.tensor_parallel_degree = {tp} must divide {', '.join(problems)}. "
            "Choose a tensor-parallel degree that divides the attention heads, the key/value "
            "heads and the sequence length."
        )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> nn.Module:
    """Shards `model` (a Llama Transformer or pipeline stage of one) over `tp_mesh`.

    With `loss_parallel` the logits stay vocabulary-sharded DTensors (Shard(-1)) for
    `torch.distributed.tensor.parallel.loss_parallel()`; otherwise they are gathered.
    """
    root_plan = {}
    if model.tok_embeddings is not None:
        # Token ids are replicated; each rank looks up its vocabulary rows, then the partial
        # embeddings are reduce-scattered into sequence shards.
        root_plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1)
        )
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
    if model.output is not None:
        root_plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)

    block_plan = {
        "attention_norm": SequenceParallel(),
        # All-gather the sequence before attention: every rank needs all positions (RoPE
        # table and causal mask index the full sequence); `rope` is a plain replicated buffer.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
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
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
    return model
