"""Gemma 3 (text) family: model, published flavors, registry entry (TP plan and activation
count in plan.py, Hugging Face names in hf.py).

Published shapes from the Gemma 3 text configs (`Gemma3ForCausalLM`, or the text part of the
multimodal 4B / 12B / 27B): RMSNorm eps 1e-6, every 6th layer global, local RoPE base 10,000,
global RoPE base 1e6 (linear scaling 8 on the 4B, 12B and 27B global layers), the output tied to
the embeddings, no soft-capping. `vocab_size` is replaced by the tokenizer's when one is
loaded.
"""

from models.contract import HFAdapter, ModelSpec, register
from models.gemma3 import hf
from models.gemma3.model import Gemma3, Gemma3Args
from models.gemma3.plan import gemma3_block_activation_bytes, gemma3_tp_plan
from models.gemma_blocks import GEMMA_FUNCTION_ARGS

# fmt: off
flavors = {
    # Every 2nd layer global (the published models: every 6th), so the tests' 2-layer tiny shape
    # has one sliding-window layer and one global layer; the window (16) is shorter than the
    # parity tests' 32-token and the presets' 64-token sequences; rope scaling on.
    "debugmodel": Gemma3Args(dim=256, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
        vocab_size=4096, sliding_window=16, sliding_window_pattern=2),
    # the 1B: another vocabulary, window 512, no RoPE scaling; the others the 12B's but shapes
    "1B": Gemma3Args(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1,
        ffn_dim=6912, vocab_size=262144, sliding_window=512, rope_scaling_factor=1.0),
    "4B": Gemma3Args(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, ffn_dim=10240),
    "12B": Gemma3Args(dim=3840, n_layers=48, n_heads=16, n_kv_heads=8, ffn_dim=15360),
    "27B": Gemma3Args(dim=5376, n_layers=62, n_heads=32, n_kv_heads=16,
        head_dim=128, ffn_dim=21504, query_pre_attn_scalar=168),
}

SPEC = register(ModelSpec(
    "gemma3", Gemma3, flavors, tp_plan=gemma3_tp_plan, hf=HFAdapter.of("gemma3_text", hf),
    block_activation_bytes=gemma3_block_activation_bytes,
    function_args=(
        *GEMMA_FUNCTION_ARGS, "rope_local_theta", "rope_scaling_factor", "sliding_window_pattern"
    ),
))
# fmt: on

__all__ = ["SPEC", "Gemma3", "Gemma3Args", "flavors"]
