"""What the framework needs to know to parallelize DeepSeek-V3, as data: the config check (the
shared MoE one), its tensor-parallel plan and the activation bytes one block saves. Where the
experts are and how routing statistics are reduced is models/moe_routing.py."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
)

from models.moe_routing import expert_split_problems
from models.tp_plan import (
    ReplicateParallel,
    TPPlan,
    decoder_tp_plan,
    moe_block_plan,
    replicated_inputs,
)


def deepseek_v3_problems(cfg, args) -> list[str]:
    """The shared MoE check: EP splits the experts evenly."""
    return expert_split_problems(cfg, args)


class LatentAttentionInput(PrepareModuleInput):
    """Latent attention's input all-gathered along the sequence (as the shared decoder's
    attention input), and its `wkv_a` replicated: every TP rank computes the whole latent and
    the rotated key that all heads share, from the same tokens.

    The gradients those two get back differ: the latent's reaches `wkv_a` whole on every rank
    (`wkv_b`'s ColwiseParallel input sums the heads' parts over the TP ranks), but the rotated
    key goes to the attention core directly, so each rank's gradient for it holds only its own
    heads' part. Its last `rope_dim` output features are therefore handed on as a tensor whose
    gradient is summed over the TP ranks (an identity forward; `to_local` with a Partial
    gradient placement), which makes `wkv_a`'s gradient equal on every rank, as its
    replicated weight needs."""

    def __init__(self):
        super().__init__(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,  # plain tensors for the replicated projections' inputs
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope_dim = module.rope_dim

        def key_gradient_summed(_, output, mesh):
            latent, key = output.to_local().split([output.shape[-1] - rope_dim, rope_dim], -1)
            key = DTensor.from_local(key, mesh, [Replicate()], run_check=False)
            return torch.cat([latent, key.to_local(grad_placements=[Partial()])], -1)

        distribute_module(
            module.wkv_a, device_mesh, input_fn=replicated_inputs, output_fn=key_gradient_summed
        )
        return super()._apply(module, device_mesh)


def deepseek_v3_tp_plan(loss_parallel: bool) -> TPPlan:
    """The shared decoder's plan for embeddings, norms, output and the dense blocks' SwiGLU,
    and the MoE layer on the whole sequence with its shared experts replicated
    (`models.tp_plan.moe_block_plan`); latent attention split by heads: the query projection
    (`wq`, or `wq_b` after the replicated bottleneck `wq_a` and its norm) and the latent's
    expansion `wkv_b` column-wise, `wo` row-wise, `wkv_a` and `kv_norm` replicated
    (`LatentAttentionInput`)."""
    dense = decoder_tp_plan(loss_parallel)
    moe = moe_block_plan(dense)
    attention = {
        "attention": LatentAttentionInput(),
        "attention.wq": ColwiseParallel(),
        "attention.wq_a": ReplicateParallel(),
        "attention.q_norm": ReplicateParallel(),
        "attention.wq_b": ColwiseParallel(),
        "attention.kv_norm": ReplicateParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    block = {k: v for k, v in dense.block.items() if not k.startswith("attention")}
    block |= {k: v for k, v in moe.block.items() if k.startswith("moe")}
    block |= {"attention_norm": dense.block["attention_norm"], **attention}
    block["moe.shared_experts"] = ReplicateParallel()
    return TPPlan(root=dense.root, block=block)


def deepseek_v3_block_activation_bytes(args, s: int, b: int, t: int = 1) -> float:
    """Activation bytes one DeepSeek-V3 block saves for backward (16-bit compute), averaged
    over the dense and MoE blocks. Per token: the two norms and their outputs (20 dim), the
    query bottleneck and its norm (6 q_lora_rank + 4), the latent and its norm (6 kv_lora_rank
    + 4 + 6 rope part), q and k in fp32 for RoPE on their rotated parts and q, k, v in bf16 for
    the core (per head 2 x 192 + 2 x 192 + 2 x 128 and 8 for the rotation), the output
    projection's input (2 h v_head_dim); a dense block's SwiGLU (8 ffn_dim + 2 dim); an MoE
    block's router (8 E), shared experts (8 n_shared moe_ffn_dim + 2 dim) and per chosen copy
    of the token its input (2 dim), SwiGLU's saved tensors (8 moe_ffn_dim) and output (2 dim).
    Under TP (`t`) with sequence parallelism the heads' part, the norms and the dense SwiGLU
    divide by t; the query bottleneck, the latent and the rotated key (replicated) and the MoE
    layer (on the whole sequence) do not."""
    h = args.n_heads
    qkv = h * (4 * args.head_dim + 2 * args.head_dim + 2 * args.v_head_dim)
    heads = 20 * args.dim + qkv + 2 * h * args.v_head_dim
    latent = 6 * args.q_lora_rank + 6 * args.kv_lora_rank + 12 * args.qk_rope_head_dim
    dense = 8 * args.ffn_dim + 2 * args.dim
    shared = 8 * args.n_shared_experts * args.moe_ffn_dim + 2 * args.dim
    moe = 8 * args.n_experts + shared + args.top_k * (4 * args.dim + 8 * args.moe_ffn_dim)
    share = args.n_dense_layers / args.n_layers
    return float(s) * b * ((heads + share * dense) / t + latent + (1 - share) * moe)
