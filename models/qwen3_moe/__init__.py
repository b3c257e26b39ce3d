"""Qwen3-MoE family: model, published flavors, registry entry (TP plan and activation count in
plan.py, Hugging Face names in hf.py; the MoE layer, its routing hooks and EP check are the
shared models/moe.py and models/moe_routing.py).

Published shapes from the Qwen3-30B-A3B and Qwen3-235B-A22B configs (128 experts, 8 chosen
per token, renormalised top-k weights, head_dim 128, 4 key/value heads, vocabulary 151,936,
untied, RoPE theta 1e6, every layer sparse). `vocab_size` is replaced by the tokenizer's when
one is loaded.
"""

from models.contract import HFAdapter, ModelSpec, register
from models.moe import MoE
from models.moe_routing import expert_split_problems, routing_hooks
from models.qwen3_moe import hf
from models.qwen3_moe.model import Qwen3MoE, Qwen3MoEArgs
from models.qwen3_moe.plan import qwen3_moe_block_activation_bytes, qwen3_moe_tp_plan

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
        validate=expert_split_problems,
        block_activation_bytes=qwen3_moe_block_activation_bytes,
        hf=HFAdapter.of("qwen3_moe", hf),
        routing=routing_hooks(("w1", "w2", "w3")),
        compile_module="attention",  # routing has data-dependent shapes (counts, EP splits)
        function_args=("rope_theta", "norm_eps"),
    )
)

__all__ = ["SPEC", "MoE", "Qwen3MoE", "Qwen3MoEArgs", "flavors"]
