"""Gemma 2 (models/gemma2/) against Hugging Face's `Gemma2ForCausalLM`, in this process: the
logits equal transformers' (sliding window shorter than the sequence, both soft-caps biting,
Gemma's softmax scale, the four (1 + weight) norms, GeGLU, the scaled embeddings, tied
output), the conversion scripts round-trip a checkpoint both ways, names and config.json
invert, and the flavors' parameter counts equal the published models'. The layouts' parity is
tests/integration/test_gemma2_parity.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_round_trip import round_trip

from models import get_model_spec
from models.gemma2 import Gemma2, flavors
from models.gemma2.hf import args_from_hf_config, from_hf_name, hf_config, to_hf_name

transformers = pytest.importorskip("transformers")

# Measured (2026-12-02): HF's float64 model still rounds to float32 in three places (its
# RMSNorm's `x.float()`, its RoPE table and its eager softmax), so its logits are float32-exact
# only: ours in float64 differ from them by at most 2.5e-6 (logits of max magnitude 4, capped).
# Kept at 4x. A sliding window one token off, a soft-cap left out or the wrong softmax scale
# moves them by more than 1e-2 (test_window_and_caps_change_the_logits).
LOGITS_TOL = 1e-5


def _hf_config(**kw):
    # 3 layers: sliding, global, sliding (transformers' layer_types: the even ones slide)
    fields = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        query_pre_attn_scalar=20, sliding_window=5, attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0, attn_implementation="eager",
    )  # fmt: skip
    return transformers.Gemma2Config(**{**fields, **kw})


def _hf_tiny(dtype=torch.float64):
    """A tiny random Gemma2ForCausalLM whose norms, caps and window all matter: weights of std
    0.3 (norms 0.2 around HF's zero), soft-caps of 3 and 4, window 5 of 24 tokens."""
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(_hf_config()).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.3))
    return model


def _ours(hf, **changes) -> Gemma2:
    args = dataclasses.replace(args_from_hf_config(hf.config.to_dict()), **changes)
    model = Gemma2(args).to(next(hf.parameters()).dtype).eval()
    model.init_buffers("cpu")
    missing, unexpected = model.load_state_dict(
        {from_hf_name(k): v for k, v in hf.state_dict().items()}, strict=False
    )
    assert not unexpected and missing in ([], ["output.weight"])  # tied: lm_head is shared
    return model


TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def test_logits_match_transformers():
    hf = _hf_tiny()
    ours = _ours(hf)
    assert ours.output.weight is ours.tok_embeddings.weight
    specs = [ours.layers[str(i)].attention.core.spec for i in range(3)]
    assert [s.window for s in specs] == [5, None, 5] and {s.softcap for s in specs} == {3.0}
    assert specs[0].scale == 20**-0.5
    with torch.no_grad():
        got, want = ours(TOKENS), hf(TOKENS).logits
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=LOGITS_TOL, atol=LOGITS_TOL)


def test_window_and_caps_change_the_logits():
    """The parity above is sensitive to every Gemma feature: without each, far off."""
    hf = _hf_tiny()
    with torch.no_grad():
        want = hf(TOKENS).logits
        for change in (
            {"sliding_window": 6},
            {"sliding_window": None},
            {"attn_softcap": None},
            {"final_softcap": None},
            {"query_pre_attn_scalar": 32},
        ):
            got = _ours(hf, **change)(TOKENS)
            assert (got - want).abs().max() > 1e-2, change


def test_names_and_config_round_trip():
    args = flavors["debugmodel"]
    with torch.device("meta"):
        names = list(Gemma2(args).state_dict())
    assert all(from_hf_name(to_hf_name(k)) == k for k in names)
    assert len({to_hf_name(k) for k in names}) == len(names)
    config = hf_config(args)
    again = transformers.Gemma2Config(**config)
    assert again.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert args_from_hf_config(again.to_dict()) == dataclasses.replace(args)
    with pytest.raises(ValueError, match="layer_types"):
        args_from_hf_config({**config, "layer_types": ["full_attention"] * args.n_layers})
    with pytest.raises(ValueError, match="hidden_activation"):
        args_from_hf_config({**config, "hidden_activation": "gelu", "hidden_act": "gelu"})


def test_converts_both_ways_by_its_family_adapter(tmp_path):
    """convert_from_hf picks Gemma 2 by model_type, convert_to_hf by the family the checkpoint
    records; the weights come back bit for bit and the re-exported model computes the same."""
    hf = _hf_tiny(torch.float32)

    def load(f):
        return transformers.Gemma2ForCausalLM.from_pretrained(f, attn_implementation="eager")

    spec, args, again = round_trip(hf, tmp_path, TOKENS, load, tied=True)
    assert spec.name == "gemma2" and args.sliding_window == 5 and args.final_softcap == 4.0
    assert again.config.layer_types == hf.config.layer_types


# the published totals (the Gemma 2 model cards: 2.6B, 9.2B, 27.2B)
PUBLISHED = {"2B": 2_614_341_888, "9B": 9_241_705_984, "27B": 27_227_128_320}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavor_counts_equal_transformers(flavor):
    args = flavors[flavor]
    with torch.device("meta"):
        ours = Gemma2(args)
        hf = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**hf_config(args)))
    count = sum(p.numel() for p in ours.parameters())  # the tied matrix is listed once
    assert count == sum(p.numel() for p in hf.parameters()) == PUBLISHED[flavor]


def test_registered_with_its_debug_window_inside_the_test_sequences():
    spec = get_model_spec("gemma2")
    assert spec.model_cls is Gemma2 and spec.hf.model_type == "gemma2"
    # the parity tests train 32-token sequences, the scaled presets 64: the window must slide
    assert flavors["debugmodel"].sliding_window < 32
