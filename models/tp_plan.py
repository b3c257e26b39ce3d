"""A model family's tensor-parallel plan, as data, and the generic decoder's plan that the
families extend.

A plan maps module paths (relative to the model root, or to each block of `model.layers`) to
torch `ParallelStyle`s, or to `REPLICATE`. It lives on the models' side: a family's
`plan.py` describes its plan with the pieces here and torch's styles, and
`parallelisms/tensor_parallel.py` applies any plan without naming a module of any model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

# A plan value that replicates a module's parameters on the TP mesh (no sharding, no layout
# change of its inputs/outputs): for small parameters that each rank needs whole.
REPLICATE = "replicate"


class ReplicateParallel(ParallelStyle):
    """A module whose parameters every TP rank keeps whole and whose (plain, identical across
    the TP ranks) inputs it runs on: parameters replicated on the TP mesh, inputs wrapped as
    replicated DTensors, outputs returned as plain tensors (a router on the tokens the TP ranks
    share, say). Its gradients are then equal on every TP rank, as its inputs are."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def unwrap(_, output, mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, input_fn=replicated_inputs, output_fn=unwrap)


def replicated_inputs(_, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """A module's plain inputs, identical on every TP rank, as replicated DTensors (the
    `input_fn` of `distribute_module` for a module whose parameters TP replicates)."""
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


class ShardSinksWithHeads(ParallelStyle):
    """An attention core with sink logits (`AttentionSpec.sinks`, one per query head) under
    ColwiseParallel q/k/v, which give each TP rank a contiguous slice of the heads: the logits
    Shard(0) on the TP mesh (the same slice), and the core handed this rank's slice as a plain
    tensor, as its q, k and v are. Their gradients stay sharded like the heads'."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                sharded = distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None)
                mod.register_parameter(key, nn.Parameter(sharded, param.requires_grad))

        def local_sinks(mod, args, kwargs):
            return args, {**kwargs, "sinks": mod.sinks.to_local()}

        distribute_module(module, device_mesh, partition_fn=shard)
        module.register_forward_pre_hook(local_sinks, with_kwargs=True)
        return module


@dataclass(frozen=True)
class TPPlan:
    """A family's TP plan: module paths (relative to the model root, or to each block of
    `model.layers`) -> a `ParallelStyle` or `REPLICATE`. Root entries whose module is absent
    (a pipeline stage without the embeddings, say) are skipped."""

    root: dict[str, ParallelStyle | str] = field(default_factory=dict)
    block: dict[str, ParallelStyle | str] = field(default_factory=dict)


def multi_token_prediction_plan() -> dict[str, ParallelStyle]:
    """Root entries for multi-token-prediction modules (models/mtp.py; their blocks take the
    block plan): the norms and the projection of the two inputs run on sequence shards with
    replicated weights, and each module's output joins the main hidden state on its way to
    `output`."""
    return {
        "mtp.*.enorm": SequenceParallel(),
        "mtp.*.hnorm": SequenceParallel(),
        "mtp.*.eh_proj": SequenceParallel(use_local_output=True),
        "mtp.*.norm": SequenceParallel(),
    }


def decoder_tp_plan(
    loss_parallel: bool, *, qk_norms: bool = False, post_norms: bool = False, sinks: bool = False
):
    """Megatron-style TP with sequence parallelism for the shared decoder shape
    (`models.blocks`: `tok_embeddings`, blocks of `attention_norm`, `attention.wq/wk/wv/wo`,
    `ffn_norm`, `feed_forward.w1/w2/w3`, then `norm` and `output`). Token ids are replicated;
    each rank looks up its vocabulary rows and the partial embeddings are reduce-scattered into
    sequence shards. Inside a block the attention and feed-forward inputs are all-gathered
    along the sequence, the input projections split by output features (each rank holds a
    slice of the heads / hidden units) and the output projections by input features, whose
    partial sums are reduce-scattered back to sequence shards; norms run on sequence shards.
    With `loss_parallel` the logits stay vocabulary-sharded (Shard(-1)) for `loss_parallel()`.
    A tied output weight is Shard(0) like the embedding's, so the two stay one tensor.

    `qk_norms`: per-head norms of q and k (`attention.q_norm`, `attention.k_norm`): their
    input is this rank's heads ([batch, seq, heads, head_dim], sharded on dim 2), each head
    normalised on its own, the weight replicated. `post_norms`: norms after attention and after
    the MLP (`post_attention_norm`, `post_ffn_norm`): they take wo's and w2's reduce-scattered
    output and hand back a plain sequence shard for the residual sum. `sinks`: the attention
    core's sink logits (`attention.core.sinks`) sharded with the heads."""
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
        **multi_token_prediction_plan(),
    }
    block = {
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
    }
    if qk_norms:
        head_norm = SequenceParallel(sequence_dim=2, use_local_output=True)
        block |= {"attention.q_norm": head_norm, "attention.k_norm": head_norm}
    if sinks:
        block["attention.core"] = ShardSinksWithHeads()
    if post_norms:
        post_norm = SequenceParallel(use_local_output=True)
        block |= {"post_attention_norm": post_norm, "post_ffn_norm": post_norm}
    return TPPlan(root=root, block=block)


def moe_block_plan(dense: TPPlan) -> TPPlan:
    """A dense decoder plan with its feed-forward replaced by a `models.moe.MoE` layer (`moe`)
    on the whole sequence: its input all-gathered like the dense feed-forward's and its output
    returned to sequence shards; every TP rank routes the same tokens with a replicated router
    and runs the experts it holds (all of them, or its EP share) on them; no expert weight is
    split over TP."""
    block = {k: v for k, v in dense.block.items() if not k.startswith("feed_forward")}
    block["moe"] = PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(Shard(1),),
        use_local_output=True,
    )
    block["moe.router"] = ReplicateParallel()
    return TPPlan(root=dense.root, block=block)
