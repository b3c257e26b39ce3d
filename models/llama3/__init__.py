"""Llama 3 family: model, published flavors, and its registry entry (the TP plan and the
activation count in plan.py, Hugging Face names in hf.py)."""

from models.contract import HFAdapter, ModelSpec, register
from models.llama3 import hf
from models.llama3.model import ModelArgs, Transformer
from models.llama3.plan import llama_block_activation_bytes, llama_tp_plan

# Published Llama 3.1 shapes and RoPE (8B, 70B and 405B all use Llama 3.1's frequency scaling;
# Llama 3.0 weights need model.rope_scaling = "none") and Llama 3.2's 1B and 3B (tied
# embeddings, RoPE scaling factor 32). `vocab_size` is replaced by the tokenizer's when one
# is loaded.
flavors = {
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=4096,
        multiple_of=256,
        rope_theta=500000,
    ),
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
        use_scaled_rope=True,
        rope_scaling_factor=32.0,
        tie_embeddings=True,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_theta=500000,
        use_scaled_rope=True,
        rope_scaling_factor=32.0,
        tie_embeddings=True,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000,
        use_scaled_rope=True,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000,
        use_scaled_rope=True,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000,
        use_scaled_rope=True,
    ),
}

# fmt: off
SPEC = register(ModelSpec(
    "llama3", Transformer, flavors, tp_plan=llama_tp_plan,
    block_activation_bytes=llama_block_activation_bytes,
    hf=HFAdapter("llama", hf.args_from_hf_config, hf.hf_config_from_args, hf.meta_to_hf,
                 hf.hf_to_meta, tensor=hf.hf_tensor),
    function_args=("rope_theta", "use_scaled_rope", "norm_eps"),
))
# fmt: on

__all__ = ["SPEC", "ModelArgs", "Transformer", "flavors"]
