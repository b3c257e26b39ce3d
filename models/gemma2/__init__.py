"""Gemma 2 family: model, published flavors, registry entry (TP plan and activation count in
plan.py, Hugging Face names in hf.py).

Published shapes from the Gemma 2 model cards' configs (vocabulary 256,000, RMSNorm eps 1e-6,
RoPE theta 10,000, sliding window 4096 on every other layer, attention soft-cap 50, final
soft-cap 30, tied output projection). `query_pre_attn_scalar` is head_dim (256) for 2B and 9B,
and dim / n_heads (144, not head_dim 128) for 27B. `vocab_size` is replaced by the tokenizer's
when one is loaded.
"""

from models.contract import HFAdapter, ModelSpec, register
from models.gemma2 import hf
from models.gemma2.model import Gemma2, Gemma2Args
from models.gemma2.plan import gemma2_block_activation_bytes, gemma2_tp_plan
from models.gemma_blocks import GEMMA_FUNCTION_ARGS

# fmt: off
flavors = {
    # a window (12) shorter than the tests' sequences (32, 64) and not a divisor of their
    # blocks; query_pre_attn_scalar (32) != head_dim (64), so the scale is Gemma's own
    "debugmodel": Gemma2Args(dim=256, n_layers=4, n_heads=4, n_kv_heads=2,
        head_dim=64, ffn_dim=512, vocab_size=4096,
        query_pre_attn_scalar=32, sliding_window=12),
    "2B": Gemma2Args(dim=2304, n_layers=26, n_heads=8, n_kv_heads=4,
        head_dim=256, ffn_dim=9216, query_pre_attn_scalar=256),
    "9B": Gemma2Args(dim=3584, n_layers=42, n_heads=16, n_kv_heads=8,
        head_dim=256, ffn_dim=14336, query_pre_attn_scalar=256),
    "27B": Gemma2Args(dim=4608, n_layers=46, n_heads=32, n_kv_heads=16,
        head_dim=128, ffn_dim=36864, query_pre_attn_scalar=144),
}

SPEC = register(ModelSpec(
    "gemma2", Gemma2, flavors, tp_plan=gemma2_tp_plan, hf=HFAdapter.of("gemma2", hf),
    block_activation_bytes=gemma2_block_activation_bytes,
    function_args=(*GEMMA_FUNCTION_ARGS, "attn_softcap", "final_softcap"),
))
# fmt: on

__all__ = ["SPEC", "Gemma2", "Gemma2Args", "flavors"]
