"""Gemma 3 (text), in this process: logits equal to transformers' `Gemma3ForCausalLM` (sliding
window shorter than the sequence, a global layer, linear RoPE scaling on the global layers),
the published text configs read into exactly our flavors and their parameter totals equal to
transformers' models, config.json round trips, and the attention specs the layers declare.
The conversion scripts are tested in tests/unit/test_hf_conversion.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import get_model_spec
from models.gemma3 import Gemma3, flavors
from models.gemma3.hf import args_from_hf_config, from_hf, from_hf_name, hf_config, to_hf_name

transformers = pytest.importorskip("transformers")

# Fields of the published text configs (Hugging Face google/gemma-3-{1b,4b,12b,27b}-pt: the
# 1B is a Gemma3ForCausalLM, the others' text_config), in the older style they are written in.
_COMMON = {"model_type": "gemma3_text", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
           "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
           "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None,
           "final_logit_softcapping": None, "attention_bias": False}  # fmt: skip
_LINEAR_8 = {"rope_type": "linear", "factor": 8.0}
PUBLISHED = {
    "1B": {"hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
           "vocab_size": 262144, "sliding_window": 512, "query_pre_attn_scalar": 256,
           "rope_scaling": None, "max_position_embeddings": 32768},
    "4B": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
           "vocab_size": 262208, "sliding_window": 1024, "query_pre_attn_scalar": 256,
           "rope_scaling": _LINEAR_8, "max_position_embeddings": 131072},
    "12B": {"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
            "vocab_size": 262208, "sliding_window": 1024, "query_pre_attn_scalar": 256,
            "rope_scaling": _LINEAR_8, "max_position_embeddings": 131072},
    "27B": {"hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
            "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
            "vocab_size": 262208, "sliding_window": 1024, "query_pre_attn_scalar": 168,
            "rope_scaling": _LINEAR_8, "max_position_embeddings": 131072},
}  # fmt: skip


def _hf_tiny(dtype: torch.dtype = torch.float64):
    """7 layers (the 6th global: the published pattern), window 8 < the 40-token inputs,
    query_pre_attn_scalar 24 != head_dim 32, linear scaling 8 on the global RoPE; random norm
    weights and matrices large enough that the attention is far from uniform."""
    config = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        sliding_window=8, query_pre_attn_scalar=24, attn_implementation="eager",
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {**_LINEAR_8, "rope_theta": 1_000_000.0}},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.15))
    return model


def test_gemma3_logits_match_transformers():
    """float64 on both sides; Hugging Face's Gemma 3 still rounds to float32 inside (its norms,
    RoPE table and softmax call .float()), so the two agree to float32 rounding: measured
    3.2e-6 max abs on logits up to 6.2 (2026-12-02). Kept at 1e-5; the smallest wrong option
    tried (norm eps 1e-5 for 1e-6) moves them 6.7e-5, a window of 9 for 8 by 4.2."""
    hf = _hf_tiny()
    args = args_from_hf_config(hf.config.to_dict())
    assert hf.config.layer_types[5] == "full_attention" and args.sliding_window_pattern == 6
    assert args.rope_scaling_factor == 8.0 and args.query_pre_attn_scalar == 24
    ours = Gemma3(args).double().eval()
    ours.init_buffers("cpu")
    ours.load_state_dict(from_hf(hf.state_dict(), args))
    assert ours.output.weight is ours.tok_embeddings.weight
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=0, atol=1e-5)
    assert all(from_hf_name(to_hf_name(k)) == k for k in ours.state_dict())
    again = transformers.Gemma3TextConfig(**hf_config(args))
    assert args_from_hf_config(again.to_dict()) == args


def test_layers_declare_their_attention():
    """Local layers: the window; global layers: none; both the query_pre_attn_scalar scale.
    The block reads the RoPE row of its kind from the shell's stacked table."""
    args = flavors["12B"]
    with torch.device("meta"):
        model = Gemma3(dataclasses.replace(args, n_layers=12))
    windows = [block.attention.core.spec.window for block in model.layers.values()]
    assert windows == [1024] * 5 + [None] + [1024] * 5 + [None]
    assert {b.attention.core.spec.scale for b in model.layers.values()} == {256**-0.5}
    assert [b.rope_row for b in model.layers.values()][4:7] == [0, 1, 0]
    assert len(model.attention_specs) == 2


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_configs_are_the_flavors_and_their_totals_equal_transformers(flavor):
    config = {**_COMMON, **PUBLISHED[flavor]}
    args = args_from_hf_config(config)
    assert dataclasses.replace(args, max_seq_len=4096) == flavors[flavor]
    with torch.device("meta"):
        ours = Gemma3(flavors[flavor])
        hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**config))
    count = sum(p.numel() for p in ours.parameters())  # the tied matrix is listed once
    assert count == sum(p.numel() for p in hf.parameters())
    if flavor == "1B":
        assert count == 999_885_952  # the published Gemma 3 1B total


def test_unreproducible_configs_are_refused():
    config = {**_COMMON, **PUBLISHED["1B"]}
    with pytest.raises(ValueError, match="final_logit_softcapping = 30.0"):
        args_from_hf_config({**config, "final_logit_softcapping": 30.0})
    types = ["full_attention"] + ["sliding_attention"] * 25
    with pytest.raises(ValueError, match="do not repeat 0 sliding-window layers"):
        args_from_hf_config({**config, "layer_types": types})


def test_family_is_registered_with_its_hf_adapter():
    spec = get_model_spec("gemma3")
    assert spec.hf.model_type == "gemma3_text" and "sliding_window" in spec.function_args
    assert flavors["debugmodel"].sliding_window < 32  # the parity tests' sequence length
