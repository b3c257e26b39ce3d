"""Qwen3-MoE family: model, published flavors, the trainer's routing hooks.

Published shapes from the Qwen3-30B-A3B and Qwen3-235B-A22B configs (128 experts, 8 chosen
per token, renormalised top-k weights, head_dim 128, 4 key/value heads, vocabulary 151,936,
untied, RoPE theta 1e6, every layer sparse). `vocab_size` is replaced by the tokenizer's when
one is loaded.
"""

from models.qwen3_moe.model import MoE, Qwen3MoE, Qwen3MoEArgs

flavors = {
    # 8 experts, 2 per token: small enough for the CPU parity tests, and EP 2 / 4 split it
    "debugmodel": Qwen3MoEArgs(
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=4096,
        n_experts=8,
        top_k=2,
        moe_ffn_dim=128,
    ),  # fmt: skip
    "30B-A3B": Qwen3MoEArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        n_experts=128,
        top_k=8,
        moe_ffn_dim=768,
    ),  # fmt: skip
    "235B-A22B": Qwen3MoEArgs(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        n_experts=128,
        top_k=8,
        moe_ffn_dim=1536,
    ),  # fmt: skip
}


def parallelize(*args, **kwargs):
    from models.qwen3_moe.parallelize import parallelize_qwen3_moe

    return parallelize_qwen3_moe(*args, **kwargs)


def pipeline(*args, **kwargs):
    from models.qwen3_moe.parallelize import pipeline_qwen3_moe

    return pipeline_qwen3_moe(*args, **kwargs)


def validate(cfg, args) -> list[str]:
    from models.qwen3_moe.parallelize import validate_qwen3_moe

    return validate_qwen3_moe(cfg, args)


def block_activation_bytes(*args) -> float:
    from models.qwen3_moe.parallelize import qwen3_moe_block_activation_bytes

    return qwen3_moe_block_activation_bytes(*args)


__all__ = [
    "MoE",
    "Qwen3MoE",
    "Qwen3MoEArgs",
    "block_activation_bytes",
    "flavors",
    "parallelize",
    "pipeline",
    "validate",
]
