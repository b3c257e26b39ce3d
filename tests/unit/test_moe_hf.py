"""Qwen3-MoE <-> Hugging Face: logits equal to transformers' `Qwen3MoeForCausalLM` both ways
(fp32), the on-disk per-expert format transformers loads without missing or unexpected keys,
config.json refusals, and parameter counts equal to the published Qwen3-MoE models'."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from checkpoint.hf import model_from_layout, read_dcp_model, read_hf_weights, write_dcp_model
from models import get_model_spec
from models.qwen3_moe import Qwen3MoE, Qwen3MoEArgs, flavors
from models.qwen3_moe import hf as moe_hf
from scripts import convert_from_hf, convert_to_hf

transformers = pytest.importorskip("transformers")

# Measured on CPU, torch 2.13, transformers 5.23, for logits up to about 10 in magnitude: the
# largest |logit difference| is 7.4e-6 / 9.2e-6 HF -> ours (norm_topk_prob True / False) and
# 9.8e-6 / 1.4e-5 ours -> HF, a few float32 ulps at 10 (9.5e-7 each).
TOL = {"rtol": 0.0, "atol": 3e-5}
TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def tiny_config(norm_topk_prob: bool, **extra):
    return transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=norm_topk_prob, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **extra,
    )  # fmt: skip


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights of std 0.3 and norms around 1, so that the routing is far from uniform and a
    mix-up of any two tensors changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.1 + 1 if "norm" in name else noise * 0.3)
    return model.float().eval()


def tiny_hf(norm_topk_prob: bool):
    return randomize(transformers.Qwen3MoeForCausalLM(tiny_config(norm_topk_prob)), 0)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_import_matches_transformers(tmp_path, norm_topk_prob):
    """HF on disk (per-expert tensors) -> convert_from_hf -> ours: the same logits; the fused
    in-memory names transformers uses give the same weights."""
    hf = tiny_hf(norm_topk_prob)
    hf.save_pretrained(tmp_path / "hf")
    on_disk = read_hf_weights(tmp_path / "hf")
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in on_disk
    assert convert_from_hf.main([str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    spec, args = model_from_layout(tmp_path / "dcp" / "step-0")
    assert spec.name == "qwen3_moe" and args.norm_topk_prob == norm_topk_prob
    ours = Qwen3MoE(args).eval()
    sd = read_dcp_model(tmp_path / "dcp" / "step-0")
    ours.load_state_dict(sd)  # strict: every tensor, expert_bias included
    torch.testing.assert_close(logits(ours), logits(hf), **TOL)
    fused = moe_hf.from_hf(hf.state_dict(), args)
    assert fused.keys() == sd.keys() and all(torch.equal(fused[k], sd[k]) for k in sd)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_export_loads_in_transformers(tmp_path, norm_topk_prob):
    """Ours -> convert_to_hf -> Qwen3MoeForCausalLM.from_pretrained: no missing, unexpected or
    mismatched key, the same logits."""
    args = moe_hf.args_from_hf_config(tiny_config(norm_topk_prob).to_dict())
    ours = randomize(Qwen3MoE(args), 1)
    model = {"name": "qwen3_moe", "flavor": "tiny", "args": dataclasses.asdict(args)}
    ckpt = write_dcp_model(ours.state_dict(), tmp_path / "dcp", {"model": model})
    assert convert_to_hf.main([str(ckpt), str(tmp_path / "hf")]) == 0
    hf, info = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert not any(info.values()), info
    torch.testing.assert_close(logits(hf.float().eval()), logits(ours), **TOL)
    # the files are what transformers itself writes for this model, tensor for tensor
    hf.save_pretrained(tmp_path / "again")
    written, again = read_hf_weights(tmp_path / "hf"), read_hf_weights(tmp_path / "again")
    assert written.keys() == again.keys() and all(torch.equal(written[k], again[k]) for k in again)


def test_round_trip_is_lossless_and_a_bias_warns(tmp_path):
    hf = tiny_hf(True)
    args = moe_hf.args_from_hf_config(hf.config.to_dict())
    hf.save_pretrained(tmp_path / "hf")
    original = read_hf_weights(tmp_path / "hf")
    ours = moe_hf.from_hf(original, args)
    back = moe_hf.to_hf(ours, args)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    ours["layers.1.moe.expert_bias"][3] = 0.5
    with pytest.warns(UserWarning, match="layers 1 have a non-zero expert_bias"):
        assert moe_hf.to_hf(ours, args).keys() == original.keys()


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"mlp_only_layers": [1]}, "mlp_only_layers = [1]"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
        ({"attention_bias": True}, "attention_bias = true"),
        ({"use_sliding_window": True, "sliding_window": 16}, "sliding-window attention"),
    ],
)
def test_unrepresentable_configs_are_refused(extra, message):
    config = tiny_config(True, **extra).to_dict()
    with pytest.raises(ValueError, match=f"cannot be reproduced: .*{re.escape(message)}"):
        moe_hf.args_from_hf_config(config)


def published(dim, n_layers, n_heads, moe_ffn_dim) -> dict:
    """The fields of the published Qwen3-30B-A3B / 235B-A22B config.json files."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": dim, "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "intermediate_size": 8 * moe_ffn_dim, "moe_intermediate_size": moe_ffn_dim,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_window_layers": n_layers,
        "use_sliding_window": False, "sliding_window": None, "attention_bias": False,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_scaling": None,
        "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16",
    }  # fmt: skip


# flavor: (published config, total parameters, active per token with the embedding and output
# matrices, the published figures in billions: cut, not rounded, to the digits shown, as
# 3.353B is published as 3.3B)
PUBLISHED = {
    "30B-A3B": (published(2048, 48, 32, 768), 30_532_122_624, 3_353_032_704, "30.5", "3.3"),
    "235B-A22B": (published(4096, 94, 64, 1536), 235_093_634_560, 22_190_763_520, "235", "22"),
}


def billions_as_published(n: int, shown: str) -> str:
    digits = len(shown.partition(".")[2])
    return f"{n * 10**digits // 10**9 / 10**digits:.{digits}f}"


def formula_counts(args: Qwen3MoEArgs) -> tuple[int, int]:
    """(total, active per token) by hand: per block attention (q, k, v, o and the head-dim QK
    norms), two norms, the router and the experts, of which a token uses top_k."""
    d, hd = args.dim, args.head_dim
    attention = 2 * d * args.n_heads * hd + 2 * d * args.n_kv_heads * hd + 2 * hd
    block = attention + 2 * d + args.n_experts * d
    expert = 3 * args.moe_ffn_dim * d
    outer = 2 * args.vocab_size * d + d  # untied embeddings and output, final norm
    total = outer + args.n_layers * (block + args.n_experts * expert)
    return total, outer + args.n_layers * (block + args.top_k * expert)


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_flavor_counts_equal_published(flavor):
    config, total, active, total_b, active_b = PUBLISHED[flavor]
    args = flavors[flavor]
    imported = moe_hf.args_from_hf_config(config)
    assert imported == dataclasses.replace(args, max_seq_len=40960)  # the flavor is that config
    with torch.device("meta"):
        ours = Qwen3MoE(args)
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config))
    assert sum(p.numel() for p in ours.parameters()) == total == formula_counts(args)[0]
    assert sum(p.numel() for p in hf.parameters()) == total
    assert billions_as_published(total, total_b) == total_b
    embedding = args.vocab_size * args.dim
    assert get_model_spec("qwen3_moe").routing.active_params(ours) + embedding == active
    assert active == formula_counts(args)[1]
    assert billions_as_published(active, active_b) == active_b


def test_dry_run_prints_total_and_active_counts(capsys):
    from training.launch import run

    assert run(["--model.name", "qwen3_moe", "--model.flavor", "30B-A3B", "--job.dry_run"]) == 0
    out = capsys.readouterr().out
    assert "30,532,122,624 parameters (30.53B;" in out
    assert "3,353,032,704 active per token (3.35B; 3,041,867,776 without embeddings)" in out


def test_config_round_trips_through_transformers(tmp_path):
    args = flavors["debugmodel"]
    config = transformers.Qwen3MoeConfig(**moe_hf.hf_config(args))
    assert moe_hf.args_from_hf_config(config.to_dict()) == args
    config.save_pretrained(tmp_path)  # transformers 5 writes num_local_experts and dtype
    assert moe_hf.args_from_hf_config(json.loads((tmp_path / "config.json").read_text())) == args
