"""The model contract, in this process: a second family (Qwen3) plugs in with no framework
edit, tied weights stay tied, model checks run with the config, registration checks its args.
The checks that start processes are in tests/integration/test_model_contract_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models import get_model_spec
from models.init_weights import materialize
from models.qwen3 import Qwen3, Qwen3Args, flavors
from models.qwen3.hf import args_from_hf_config, from_hf_name, hf_config, to_hf_name

ROOT = Path(__file__).resolve().parents[2]
transformers = pytest.importorskip("transformers")


def _hf_tiny(tied: bool):
    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        max_position_embeddings=64, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():  # HF initialises norms to 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_logits_match_transformers(tied):
    hf = _hf_tiny(tied)
    args = args_from_hf_config(hf.config.to_dict())
    assert args.tie_embeddings == tied and args.head_dim == 32 and args.dim // args.n_heads == 16
    ours = Qwen3(args).eval()
    sd = {from_hf_name(k): v for k, v in hf.state_dict().items()}
    missing, unexpected = ours.load_state_dict(sd, strict=False)
    assert not unexpected and (missing == [] or (tied and missing == ["output.weight"]))
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)
    # names and config round-trip
    assert all(from_hf_name(to_hf_name(k)) == k for k in ours.state_dict())
    again = transformers.Qwen3Config(**hf_config(args))
    assert args_from_hf_config(again.to_dict()) == args


@pytest.mark.parametrize("flavor", ["0.6B", "1.7B", "4B", "8B", "14B", "32B"])
def test_qwen3_flavor_counts_equal_transformers(flavor):
    args = flavors[flavor]
    with torch.device("meta"):
        ours = Qwen3(args)
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**hf_config(args)))
    count = sum(p.numel() for p in ours.parameters())  # a tied matrix is listed once
    assert count == sum(p.numel() for p in hf.parameters())
    if flavor == "0.6B":
        assert count == 596_049_920  # the published Qwen3-0.6B total


def test_tied_weights_survive_materialisation():
    args = Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=128,
                     vocab_size=256)  # fmt: skip
    with torch.device("meta"):
        model = Qwen3(args)
    model.to_empty(device="cpu")
    assert model.output.weight is not model.tok_embeddings.weight  # what to_empty does
    materialize(model, seed=0, device="cpu")
    assert model.output.weight is model.tok_embeddings.weight
    # embeddings (= output) + final norm + 2 blocks x 11: the tied matrix is one parameter
    assert len(list(model.parameters())) == len(dict(model.named_parameters())) == 24


def test_family_checks_run_with_the_config():
    from job_config import parse_args
    from parallelisms.decoder import decoder_problems
    from training.preflight import check_config

    base = ["--config", "debug_model", "--model.name", "qwen3", "--model.flavor", "debugmodel"]
    cfg = parse_args([*base, "--parallelism.expert_parallel_degree", "2",
                      "--parallelism.tensor_parallel_degree", "3"])  # fmt: skip
    with pytest.raises(ValueError) as e:
        check_config(cfg, world_size=6)
    text = str(e.value)
    assert "'qwen3' has no experts" in text
    assert "tensor_parallel_degree = 3 must divide" in text  # both, in one message
    # tied embeddings compose with PP (the copy on the last stage: parallelisms/tied_weights.py)
    for flavor in ("debugmodel", "debugmodel_untied"):
        cfg = parse_args([*base[:-1], flavor, "--parallelism.pipeline_parallel_degree", "2"])
        check_config(cfg, world_size=2)
        assert decoder_problems(get_model_spec("qwen3"), cfg, flavors[flavor]) == []


def test_register_checks_the_args_the_framework_reads():
    import dataclasses as dc

    from models import register

    llama = get_model_spec("llama3")
    with pytest.raises(ValueError, match=r"flavor 'x'.*head_dim \(int\)"):
        register(dc.replace(llama, name="bad", flavors={"x": dc.make_dataclass("A", ["dim"])(1)}))
    with pytest.raises(ValueError, match="registered twice"):
        register(dc.replace(llama))
