"""gpt-oss (models/gpt_oss/) against Hugging Face's `GptOssForCausalLM`, in this process: the
logits equal transformers' (sinks, a window shorter than the sequence, YaRN, attention and
expert biases, the router bias, clamps that bite), each of those features moves them, the
conversion scripts round-trip a checkpoint both ways, names and config.json invert with their
refusals, and the flavors' parameter counts equal the published models'. The layouts' parity
is in tests/integration/test_fp64_parity.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_round_trip import round_trip

from models import get_model_spec
from models.gpt_oss import GptOss, flavors
from models.gpt_oss.hf import (
    args_from_hf_config,
    config_with_dtype,
    from_hf,
    from_hf_name,
    to_hf_name,
)

transformers = pytest.importorskip("transformers")

# Measured (2026-12-05): HF's float64 model rounds to float32 in its RMSNorm (`x.float()`) and
# its RoPE table (float32 angles), so ours in float64 differ from its logits (max magnitude
# about 3) by at most 3.7e-7. Kept at 4x; each feature left out moves them by more than 1e-2
# (test_each_feature_moves_the_logits).
LOGITS_TOL = 1.5e-6
YARN = dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0, beta_fast=8.0, beta_slow=1.0,
            truncate=False, original_max_position_embeddings=16)  # fmt: skip
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def _hf_config(**kw):
    # 3 layers: sliding (5 tokens), full, sliding; 4 experts, 2 per token
    fields = dict(
        vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        sliding_window=5, num_local_experts=4, num_experts_per_tok=2, rope_parameters=YARN,
        swiglu_limit=2.0,
        attn_implementation="eager", experts_implementation="eager",
    )  # fmt: skip
    return transformers.GptOssConfig(**{**fields, **kw})


def _hf_tiny(dtype=torch.float64):
    """A tiny random GptOssForCausalLM whose every feature matters: weights of std 0.5, norms
    0.2 x (1 +- 0.2), non-zero biases and sinks, and a clamp of 2 (the published 7 would not
    bite at these activations)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(_hf_config()).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = 0.2 * (1 + 0.2 * torch.randn_like(p))
            p.copy_(norm if "norm" in name else 0.5 * torch.randn_like(p))
    return model


def _ours(hf, **changes) -> GptOss:
    args = dataclasses.replace(args_from_hf_config(hf.config.to_dict()), **changes)
    model = GptOss(args).to(next(hf.parameters()).dtype).eval()
    model.init_buffers("cpu")
    model.load_state_dict(from_hf(dict(hf.state_dict()), args))
    return model


def test_logits_match_transformers():
    hf = _hf_tiny()
    ours = _ours(hf)
    specs = [ours.layers[str(i)].attention.core.spec for i in range(3)]
    assert [s.window for s in specs] == [5, None, 5] and all(s.sinks for s in specs)
    with torch.no_grad():
        got, want = ours(TOKENS), hf(TOKENS).logits
        pre = hf.model.layers[0].mlp.experts
        h = hf.model.layers[0].post_attention_layernorm(hf.model.embed_tokens(TOKENS))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=LOGITS_TOL, atol=LOGITS_TOL)
    # the clamp bites: some pre-activation of layer 0's experts is beyond the limit
    assert (h @ pre.gate_up_proj[0] + pre.gate_up_proj_bias[0]).abs().max() > pre.limit


def test_each_feature_moves_the_logits():
    """The parity above is sensitive to every gpt-oss feature: without each, far off."""
    hf = _hf_tiny()
    with torch.no_grad():
        want = hf(TOKENS).logits
        for change in (
            {"sliding_window": 6},
            {"swiglu_limit": 1e9},
            {"swiglu_alpha": 1.0},
            {"rope_factor": 1.0},
            {"rope_old_context": 64},
        ):
            assert (_ours(hf, **change)(TOKENS) - want).abs().max() > 1e-2, change
        for name in ("self_attn.sinks", "mlp.router.bias", "self_attn.q_proj.bias"):
            ours = _ours(hf)
            ours.get_parameter(from_hf_name(f"model.layers.1.{name}")).zero_()
            assert (ours(TOKENS) - want).abs().max() > 1e-2, name


def test_names_and_config_round_trip():
    args = flavors["debugmodel"]
    with torch.device("meta"):
        names = [n for n in GptOss(args).state_dict() if not n.endswith("expert_bias")]
    assert all(from_hf_name(to_hf_name(k)) == k for k in names)
    assert len({to_hf_name(k) for k in names}) == len(names)
    config = config_with_dtype(args, torch.bfloat16)
    again = transformers.GptOssConfig(**config)
    assert again.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert args_from_hf_config(again.to_dict()) == dataclasses.replace(args)
    for bad, match in (
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
        ({"layer_types": ["full_attention"] * args.n_layers}, "layer_types"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": None},
         "rope_type"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            args_from_hf_config({**config, **bad})
    with pytest.raises(ValueError, match="Mxfp4Config"):
        from_hf({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(1)}, args)


def test_converts_both_ways_by_its_family_adapter(tmp_path):
    """convert_from_hf picks gpt-oss by model_type, convert_to_hf by the family the checkpoint
    records; the weights come back bit for bit and the re-exported model computes the same."""
    hf = _hf_tiny(torch.float32)

    def load(f):
        return transformers.GptOssForCausalLM.from_pretrained(
            f, attn_implementation="eager", experts_implementation="eager"
        )

    spec, args, again = round_trip(hf, tmp_path, TOKENS, load)
    assert spec.name == "gpt_oss" and args.sliding_window == 5 and args.rope_factor == 4.0
    assert again.config.layer_types == hf.config.layer_types


# the published totals (transformers' GptOssForCausalLM of the released configs; the model
# cards' 21B / 3.6B active and 117B / 5.1B active)
PUBLISHED = {"20B": (20_914_757_184, 3_608_307_264), "120B": (116_829_156_672, 5_132_849_472)}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavor_counts_equal_transformers(flavor):
    args = flavors[flavor]
    spec = get_model_spec("gpt_oss")
    with torch.device("meta"):
        ours = GptOss(args)
        config = {**config_with_dtype(args, torch.bfloat16), "experts_implementation": "eager"}
        hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters()) == PUBLISHED[flavor][0]
    embeddings = ours.tok_embeddings.weight.numel()
    assert spec.routing.active_params(ours) - embeddings == PUBLISHED[flavor][1] - embeddings


def test_registered_with_its_debug_window_inside_the_test_sequences():
    spec = get_model_spec("gpt_oss")
    assert spec.model_cls is GptOss and spec.hf.model_type == "gpt_oss"
    # the parity tests train 32-token sequences, the scaled presets 64: the window must slide
    assert flavors["debugmodel"].sliding_window < 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_experts_equal_the_per_expert_loop(dtype):
    """The grouped matmul (torch._grouped_mm in float32, the padded batched matmul in float64)
    with the rows' biases equals one matmul per expert, an empty expert included."""
    from models.gpt_oss.model import ClampedSwiGLUExperts

    args = dataclasses.replace(flavors["debugmodel"], dim=32, moe_ffn_dim=16, swiglu_limit=1.0)
    grouped = ClampedSwiGLUExperts(args).to(dtype)
    with torch.no_grad():
        for p in grouped.parameters():
            p.copy_(torch.randn_like(p))
    loop = ClampedSwiGLUExperts(dataclasses.replace(args, moe_grouped_mm=False)).to(dtype)
    loop.load_state_dict(grouped.state_dict())
    counts = torch.tensor([3, 0, 5, 1, 2, 0, 4, 1])
    x = torch.randn(int(counts.sum()), 32, dtype=dtype)
    torch.testing.assert_close(grouped(x, counts), loop(x, counts))
