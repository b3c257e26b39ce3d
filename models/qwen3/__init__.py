"""Qwen3 dense family: model, published flavors, registry entry (TP plan and activation count
in plan.py, Hugging Face names in hf.py).

Published shapes from the Qwen3 model cards' configs (vocabulary 151,936, RMSNorm eps 1e-6,
RoPE theta 1e6, head_dim 128; the 0.6B, 1.7B and 4B models tie the output projection to the
embeddings). `vocab_size` is replaced by the tokenizer's when one is loaded.
"""

import dataclasses

from models.contract import HFAdapter, ModelSpec, register
from models.qwen3 import hf
from models.qwen3.model import Qwen3, Qwen3Args
from models.qwen3.plan import qwen3_block_activation_bytes, qwen3_tp_plan

_DEBUG = Qwen3Args(
    dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=512, vocab_size=4096
)
flavors = {
    # tied, and head_dim (32) != dim / n_heads (64): the tests exercise both
    "debugmodel": _DEBUG,
    "debugmodel_untied": dataclasses.replace(_DEBUG, tie_embeddings=False),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728),
    "8B": Qwen3Args(
        dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, tie_embeddings=False
    ),
    "14B": Qwen3Args(
        dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408, tie_embeddings=False
    ),
    "32B": Qwen3Args(
        dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600, tie_embeddings=False
    ),
}


# fmt: off
SPEC = register(ModelSpec(
    "qwen3", Qwen3, flavors, tp_plan=qwen3_tp_plan, hf=HFAdapter.of("qwen3", hf),
    block_activation_bytes=qwen3_block_activation_bytes, function_args=("rope_theta", "norm_eps"),
))
# fmt: on

__all__ = ["SPEC", "Qwen3", "Qwen3Args", "flavors"]
