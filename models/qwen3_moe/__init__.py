"""Qwen3-MoE family: model, published flavors, registry entry (TP plan, EP check and activation
count in plan.py, routing hooks in routing.py, Hugging Face names in hf.py).

Published shapes from the Qwen3-30B-A3B and Qwen3-235B-A22B configs (128 experts, 8 chosen
per token, renormalised top-k weights, head_dim 128, 4 key/value heads, vocabulary 151,936,
untied, RoPE theta 1e6, every layer sparse). `vocab_size` is replaced by the tokenizer's when
one is loaded.
"""

from models.contract import HFAdapter, ModelSpec, RoutingHooks, register
from models.qwen3_moe import hf, routing
from models.qwen3_moe.model import MoE, Qwen3MoE, Qwen3MoEArgs
from models.qwen3_moe.plan import (
    qwen3_moe_block_activation_bytes,
    qwen3_moe_tp_plan,
    validate_qwen3_moe,
)

# fmt: off
flavors = {
    # 8 experts, 2 per token: small enough for the CPU parity tests, and EP 2 / 4 split it
    "debugmodel": Qwen3MoEArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
        vocab_size=4096, n_experts=8, top_k=2, moe_ffn_dim=128),
    "30B-A3B": Qwen3MoEArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
        n_experts=128, top_k=8, moe_ffn_dim=768),
    "235B-A22B": Qwen3MoEArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4,
        n_experts=128, top_k=8, moe_ffn_dim=1536),
}
# fmt: on


SPEC = register(
    ModelSpec(
        "qwen3_moe",
        Qwen3MoE,
        flavors,
        tp_plan=qwen3_moe_tp_plan,
        validate=validate_qwen3_moe,
        block_activation_bytes=qwen3_moe_block_activation_bytes,
        hf=HFAdapter.of("qwen3_moe", hf),
        routing=RoutingHooks(
            experts=routing.experts,
            expert_weights=routing.EXPERT_WEIGHTS,
            set_stats_reduce=routing.set_stats_reduce,
            set_counting=routing.set_counting,
            set_loss_scale=routing.set_loss_scale,
            after_optimizer_step=routing.after_optimizer_step,
            layer_stats=routing.layer_stats,
            summarize=routing.summarize,
            active_params=routing.active_params,
        ),
        compile_module="attention",  # routing has data-dependent shapes (counts, EP splits)
        function_args=("rope_theta", "norm_eps"),
    )
)

__all__ = ["SPEC", "MoE", "Qwen3MoE", "Qwen3MoEArgs", "flavors"]
