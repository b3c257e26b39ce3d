"""DeepSeek-V3 family: model, published flavors, registry entry (what the framework needs to
parallelize it in plan.py, Hugging Face names in hf.py; the MoE layer, its routing hooks and EP
check are the shared models/moe.py and models/moe_routing.py).

Published shapes from the DeepSeek-V3 config: dim 7168, 61 layers (the first 3 dense, SwiGLU of
18,432), 128 heads of latent attention (query rank 1536, key/value rank 512, head parts 128
without position and 64 rotated, values 128), 256 routed experts of 2048 in 8 groups (4 kept,
8 experts chosen per token, sigmoid scores, weights x 2.5) and one shared expert, YaRN RoPE
(theta 10,000, factor 40 over 4,096 tokens, 163,840 positions, mscale 1), vocabulary 129,280,
untied. Its parameter count, 671,026,404,352, is transformers' `DeepseekV3ForCausalLM` of that
config (the checkpoint's multi-token-prediction layer, 14B more, is not part of it).
`vocab_size` is replaced by the tokenizer's when one is loaded.
"""

from models.contract import HFAdapter, ModelSpec, register
from models.deepseek_v3 import hf
from models.deepseek_v3.model import DeepSeekV3, DeepSeekV3Args
from models.deepseek_v3.plan import (
    deepseek_v3_block_activation_bytes,
    deepseek_v3_problems,
    deepseek_v3_tp_plan,
)
from models.moe_routing import routing_hooks

# fmt: off
flavors = {
    # 8 experts in 4 groups (2 kept), 2 per token, one shared; the first of 4 layers dense;
    # YaRN over a 256-token old context
    "debugmodel": DeepSeekV3Args(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=48,
        vocab_size=4096, max_seq_len=2048, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, ffn_dim=512, n_dense_layers=1, n_experts=8, top_k=2,
        moe_ffn_dim=128, moe_n_groups=4, moe_topk_groups=2, rope_factor=4.0,
        rope_old_context=256),
    "671B": DeepSeekV3Args(),
}

SPEC = register(ModelSpec(
    "deepseek_v3", DeepSeekV3, flavors, tp_plan=deepseek_v3_tp_plan,
    validate=deepseek_v3_problems, block_activation_bytes=deepseek_v3_block_activation_bytes,
    hf=HFAdapter.of("deepseek_v3", hf),
    routing=routing_hooks(("w1", "w2", "w3")),
    compile_module="attention",  # routing has data-dependent shapes (counts, EP splits)
    function_args=("rope_theta", "norm_eps", "rope_factor", "rope_old_context", "rope_beta_fast",
                   "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim"),
))
# fmt: on

__all__ = ["SPEC", "DeepSeekV3", "DeepSeekV3Args", "flavors"]
