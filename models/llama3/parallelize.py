"""How Llama 3 is parallelized: its TP plan and FSDP units as data, and the order the generic
parallelisms are applied in: tensor parallel -> activation checkpointing -> compile -> data
parallel (FSDP2 / ZeRO). Works on the whole model or on one pipeline stage of it."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from parallelisms.activation_checkpoint import apply_ac
from parallelisms.compile import apply_compile
from parallelisms.data_parallel import apply_data_parallel
from parallelisms.fsdp import FsdpUnit, embed_blocks_head_units
from parallelisms.parallel_dims import ParallelDims, ParallelismError, tied_weight_problems
from parallelisms.tensor_parallel import TPPlan, apply_tp, check_tp


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


def llama_fsdp_units(model: nn.Module) -> list[FsdpUnit]:
    """The token embeddings (first in forward), each block, then the final norm and output
    projection together (last in forward, first in backward); tied, the embeddings join that
    last unit."""
    return embed_blocks_head_units(
        model, ["tok_embeddings"], ["norm", "output"], model.args.tie_embeddings
    )


def parallelize_llama(
    model: nn.Module, parallel_dims: ParallelDims, job_config, device_type: str
) -> nn.Module:
    p, ac, comp = job_config.parallelism, job_config.activation_checkpoint, job_config.compile
    if parallel_dims.tp_enabled:
        # First: TP turns the weights into tp-sharded DTensors, which FSDP then shards on dp,
        # and its collectives belong inside the blocks that AC recomputes and compile traces.
        apply_tp(model, parallel_dims.dim("tp"), llama_tp_plan(not p.disable_loss_parallel))
        model.tie_weights()  # TP distributed the two tied modules' weights one by one
    if ac.mode != "none":
        # Before compile, so each compiled block graph contains its checkpointing policy.
        apply_ac(model, ac.mode, ac.selective_ac_option)
    if comp.enable and "model" in comp.components:
        # Before data parallelism, so FSDP/ZeRO hooks run around the compiled blocks, not in them.
        apply_compile(model)
    if parallel_dims.data_parallel_enabled:
        # Last: FSDP wraps the final block modules (its units) and shards whatever TP made.
        apply_data_parallel(model, parallel_dims, job_config, device_type, llama_fsdp_units)
    return model


def validate_llama(cfg, args) -> list[str]:
    """What a Llama run cannot do, found from the config before any process group starts."""
    try:
        check_tp(args.n_heads, args.kv_heads, cfg.training.seq_len,
                 cfg.parallelism.tensor_parallel_degree)  # fmt: skip
    except ParallelismError as e:
        problems = [str(e)]
    else:
        problems = []
    if args.tie_embeddings:
        problems += tied_weight_problems(cfg.parallelism, cfg.model.flavor)
    return problems


def llama_block_activation_bytes(args, s: int, b: int, t: int = 1) -> float:
    """Activation bytes one Llama block saves for backward (16-bit compute, fused attention),
    counted from the tensors autograd keeps: each RMSNorm its input and output in fp32 and the
    16-bit matmul input (2 x 10 sbh), attention q, k, v (k/v repeated to all heads) and its
    output (8 sbh), SwiGLU's w1 and w3 outputs, SiLU output and product (8 sbf). sbh(28 + 8f/h)
    in all (Korthikanti's GPT count is 34 sbh with a 4h GeLU MLP); divided by t under TP +
    sequence parallelism. The estimator's activation figure per layer."""
    return float(s) * b * (28 * args.dim + 8 * args.ffn_hidden_dim) / t
