"""What the framework needs to know to parallelize DeepSeek-V3, as data: the config check of
what it cannot run (tensor parallelism: no plan for latent attention yet), its TP plan's
place, and the activation bytes one block saves. Where the experts are and how routing
statistics are reduced is models/moe_routing.py."""

from __future__ import annotations

from models.moe_routing import expert_split_problems
from models.tp_plan import TPPlan


def deepseek_v3_problems(cfg, args) -> list[str]:
    """The shared MoE check (EP splits the experts evenly), and tensor parallelism refused:
    latent attention's rotated key is shared by every head, so a head-sharded plan must sum
    its gradient over the TP ranks, which no plan here does yet."""
    problems = expert_split_problems(cfg, args)
    if cfg.parallelism.tensor_parallel_degree > 1:
        problems.append(
            f"parallelism.tensor_parallel_degree = {cfg.parallelism.tensor_parallel_degree} "
            "with model.name = 'deepseek_v3': its latent attention has no tensor-parallel "
            "plan (the rotated key every head shares needs its gradient summed over the TP "
            "ranks). Use data, expert, pipeline or context parallelism (TP 1)."
        )
    return problems


def deepseek_v3_tp_plan(loss_parallel: bool) -> TPPlan:
    """None yet: the config check refuses TP for this family (`deepseek_v3_problems`)."""
    raise ValueError("deepseek_v3 has no tensor-parallel plan (the config check refuses TP)")


def deepseek_v3_block_activation_bytes(args, s: int, b: int, t: int = 1) -> float:
    """Activation bytes one DeepSeek-V3 block saves for backward (16-bit compute), averaged
    over the dense and MoE blocks. Per token: the two norms and their outputs (20 dim), the
    query bottleneck and its norm (6 q_lora_rank + 4), the latent and its norm (6 kv_lora_rank
    + 4 + 6 rope part), q and k in fp32 for RoPE on their rotated parts and q, k, v in bf16 for
    the core (per head 2 x 192 + 2 x 192 + 2 x 128 and 8 for the rotation), the output
    projection's input (2 h v_head_dim); a dense block's SwiGLU (8 ffn_dim + 2 dim); an MoE
    block's router (8 E), shared experts (8 n_shared moe_ffn_dim + 2 dim) and per chosen copy
    of the token its input (2 dim), SwiGLU's saved tensors (8 moe_ffn_dim) and output (2 dim)."""
    h = args.n_heads
    qkv = h * (4 * args.head_dim + 2 * args.head_dim + 2 * args.v_head_dim)
    attention = (
        20 * args.dim + 6 * args.q_lora_rank + 6 * args.kv_lora_rank + 12 * args.qk_rope_head_dim
        + qkv + 2 * h * args.v_head_dim
    )  # fmt: skip
    dense = 8 * args.ffn_dim + 2 * args.dim
    shared = 8 * args.n_shared_experts * args.moe_ffn_dim + 2 * args.dim
    moe = 8 * args.n_experts + shared + args.top_k * (4 * args.dim + 8 * args.moe_ffn_dim)
    share = args.n_dense_layers / args.n_layers
    return float(s) * b * (attention / t + share * dense + (1 - share) * moe)
