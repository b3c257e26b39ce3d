"""gpt-oss family: model, published flavors, registry entry (TP plan and activation count in
plan.py, Hugging Face names in hf.py; the MoE layer and its routing hooks are the shared
models/moe.py and models/moe_routing.py).

Published shapes from the gpt-oss-20b and gpt-oss-120b configs: dim 2880, 64 query and 8
key/value heads of 64, experts of 2880 with 4 chosen per token (32 experts in 24 layers; 128 in
36), a 128-token window on every other layer, YaRN RoPE (theta 150,000, factor 32 over 4,096
tokens, 131,072 positions), vocabulary 201,088, untied. Their parameter counts, 20,914,757,184
and 116,829,156,672, are transformers' `GptOssForCausalLM` of those configs. `vocab_size` is
replaced by the tokenizer's when one is loaded.
"""

from models.contract import HFAdapter, MatrixLayout, ModelSpec, register
from models.gpt_oss import hf
from models.gpt_oss.model import GptOss, GptOssArgs
from models.gpt_oss.plan import gpt_oss_block_activation_bytes, gpt_oss_tp_plan
from models.moe_routing import expert_split_problems, routing_hooks

# fmt: off
flavors = {
    # 8 experts, 4 per token (gpt-oss's top-4), a 16-token window (shorter than the parity
    # tests' 32-token sequences), YaRN over a 256-token old context (its ramp inside head_dim)
    "debugmodel": GptOssArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
        vocab_size=4096, n_experts=8, moe_ffn_dim=128, sliding_window=16, max_seq_len=2048,
        rope_factor=8.0, rope_old_context=256),
    "20B": GptOssArgs(n_layers=24, n_experts=32),
    "120B": GptOssArgs(n_layers=36, n_experts=128),
}

SPEC = register(ModelSpec(
    "gpt_oss", GptOss, flavors, tp_plan=gpt_oss_tp_plan, validate=expert_split_problems,
    block_activation_bytes=gpt_oss_block_activation_bytes, hf=HFAdapter.of("gpt_oss", hf),
    routing=routing_hooks(("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")),
    compile_module="attention",  # routing has data-dependent shapes (counts, EP splits)
    no_decay=("norm", "tok_embeddings", "bias", "sinks"),
    # Muon: experts stored [E, in, out]; gate_up_proj holds gate and up columns interleaved
    matrix_layouts={"gate_up_proj": MatrixLayout(interleaved=2, rows_last=True),
                    "down_proj": MatrixLayout(rows_last=True)},
    function_args=("rope_theta", "norm_eps", "rope_factor", "rope_old_context", "rope_beta_fast",
                   "rope_beta_slow", "rope_truncate", "sliding_window", "swiglu_alpha",
                   "swiglu_limit"),
))
# fmt: on

__all__ = ["SPEC", "GptOss", "GptOssArgs", "flavors"]
