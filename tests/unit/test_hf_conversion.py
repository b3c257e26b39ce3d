"""HF Llama <-> DCP conversion: lossless round trip, logits equal to `transformers`."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoint.hf import read_hf_weights
from checkpoint.storage import is_complete, read_layout
from models.llama3.hf import args_from_hf_config, permute_from_hf, permute_to_hf
from models.llama3.model import Transformer

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_hf_model(scaled_rope: bool, tied: bool, factor: float = 8.0):
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if scaled_rope:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        rope_parameters=rope,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # random norms too, so that a mix-up of norms would show
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.1) + ("norm" in name))
    return model


def our_model_from(ckpt_dir: Path, hf_config: dict) -> Transformer:
    args = args_from_hf_config(hf_config)
    model = Transformer(args).eval()
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(ckpt_dir), no_dist=True)
    model.load_state_dict(sd["model"])
    return model


def test_permutation_inverts_and_matches_rope_convention():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(permute_from_hf(permute_to_hf(w, 4), 4), w)
    # HF row r*hd/2 + i of a head is Meta row 2i + r
    hf = permute_to_hf(w, 4)
    assert torch.equal(hf[16 + 8 + 3], w[16 + 2 * 3 + 1])
    assert torch.equal(hf[16 + 3], w[16 + 2 * 3])


@pytest.mark.parametrize(
    "scaled_rope,tied,sharded,factor",
    [(False, False, True, 8.0), (True, False, False, 8.0), (True, True, False, 32.0)],
    ids=["llama3.0-style", "llama3.1-style", "llama3.2-style-tied"],
)
def test_hf_round_trip_and_logits(tmp_path, scaled_rope, tied, sharded, factor):
    hf_model = tiny_hf_model(scaled_rope, tied, factor)
    hf_dir = tmp_path / "hf"
    hf_model.save_pretrained(hf_dir, max_shard_size="60KB" if sharded else "1GB")
    assert (hf_dir / "model.safetensors.index.json").is_file() == sharded
    hf_config = json.loads((hf_dir / "config.json").read_text())

    assert load_script("convert_from_hf").main([str(hf_dir), str(tmp_path / "dcp")]) == 0
    ckpt = tmp_path / "dcp" / "step-0"
    assert is_complete(ckpt) and read_layout(ckpt)["kind"] == "converted"

    ours = our_model_from(ckpt, hf_config)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied  # one parameter, tied
    assert ours.args.rope_scaling_factor == factor and ours.args.use_scaled_rope == scaled_rope
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)

    out = tmp_path / "hf_back"
    assert load_script("convert_to_hf").main([str(ckpt), str(out), "--max_shard_gb", "1"]) == 0
    original, back = read_hf_weights(hf_dir), read_hf_weights(out)
    if tied:  # we always write lm_head; it equals the tied embedding
        original["lm_head.weight"] = original["model.embed_tokens.weight"]
    assert original.keys() == back.keys()
    for k in original:
        assert torch.equal(original[k], back[k]), k
    # a second export into the same folder is refused (stale shards would shadow it)
    assert load_script("convert_to_hf").main([str(ckpt), str(out)]) == 1
    assert read_hf_weights(out).keys() == back.keys()
    exported = json.loads((out / "config.json").read_text())
    assert exported["tie_word_embeddings"] == tied
    assert (exported["rope_scaling"] or {}).get("factor", factor) == factor
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, ref, rtol=1e-5, atol=1e-5)


def _scripts_round_trip(tmp_path, hf_model, vocab: int):
    """Saves `hf_model`, converts it in with convert_from_hf.py (the family picked by its
    model_type), checks our logits equal its own, converts the checkpoint back with
    convert_to_hf.py (the family the checkpoint records) and checks the reloaded model's
    logits; returns (spec, args) from the converted checkpoint and the HF folder written back."""
    from checkpoint.hf import model_from_layout, read_dcp_model

    hf_model.save_pretrained(tmp_path / "hf")
    assert load_script("convert_from_hf").main([str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    ckpt = tmp_path / "dcp" / "step-0"
    spec, args = model_from_layout(ckpt)
    ours = spec.model_cls(args).eval()
    ours.load_state_dict(read_dcp_model(ckpt))
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(tokens).logits
        torch.testing.assert_close(ours(tokens), ref, rtol=1e-4, atol=1e-4)
    assert load_script("convert_to_hf").main([str(ckpt), str(tmp_path / "back")]) == 0
    back = type(hf_model).from_pretrained(tmp_path / "back").float().eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, ref, rtol=1e-5, atol=1e-5)
    return spec, args, tmp_path / "back"


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_converts_both_ways_by_its_family_adapter(tmp_path, tied):
    """The scripts pick the family from job_config.json's model_type (in) and from the family the
    checkpoint records (out): a Qwen3 checkpoint round-trips and its logits equal the HF
    model's."""
    config = transformers.Qwen3Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = transformers.Qwen3ForCausalLM(config).float().eval()
    spec, args, _ = _scripts_round_trip(tmp_path, hf_model, 96)
    assert spec.name == "qwen3" and args.tie_embeddings == tied and args.head_dim == 32


def test_gemma3_converts_both_ways_by_its_family_adapter(tmp_path):
    """A Gemma 3 text checkpoint (model_type gemma3_text, tied, a global layer after two
    sliding-window ones, linear RoPE scaling) converts in and out by the scripts, its logits
    equal the HF model's, and the weights come back bit for bit (lm_head: the tied
    embedding)."""
    config = transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        sliding_window=8, sliding_window_pattern=3, query_pre_attn_scalar=32,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForCausalLM(config).float().eval()
    with torch.no_grad():  # HF starts the (1 + weight) norms at 0: make them matter
        for name, p in hf_model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    spec, args, back = _scripts_round_trip(tmp_path, hf_model, 96)
    assert spec.name == "gemma3" and args.sliding_window_pattern == 3
    assert args.rope_scaling_factor == 8.0 and args.tie_embeddings
    original, written = read_hf_weights(tmp_path / "hf"), read_hf_weights(back)
    original["lm_head.weight"] = original["model.embed_tokens.weight"]
    assert original.keys() == written.keys()
    assert all(torch.equal(original[k], written[k]) for k in original)
    layer_types = json.loads((back / "config.json").read_text())["layer_types"]
    assert layer_types == hf_model.config.layer_types


def test_a_family_without_an_adapter_is_refused(tmp_path, capsys):
    import dataclasses as dc

    from checkpoint.hf import write_dcp_model
    from models import MODELS, get_model_spec, register

    llama = get_model_spec("llama3")
    register(dc.replace(llama, name="no_adapter", hf=None))
    try:
        args = dc.replace(llama.flavors["debugmodel"], n_layers=1)
        sd = Transformer(args).state_dict()
        model = {"name": "no_adapter", "flavor": "x", "args": dc.asdict(args)}
        ckpt = write_dcp_model(sd, tmp_path / "ckpt", {"kind": "converted", "model": model})
        assert load_script("convert_to_hf").main([str(ckpt), str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert "model family 'no_adapter' has no Hugging Face adapter" in err
        assert "llama3" in err and "qwen3" in err
    finally:
        del MODELS["no_adapter"]


@pytest.mark.parametrize("model", [{}, {"args": {"dim": 64}}, {"name": "llama3"}])
def test_a_layout_naming_no_family_or_arguments_is_refused(tmp_path, model):
    from checkpoint.hf import model_from_layout
    from checkpoint.storage import LAYOUT_FILE, CheckpointError

    (tmp_path / LAYOUT_FILE).write_text(json.dumps({"model": model}))
    with pytest.raises(CheckpointError, match="does not record the model family"):
        model_from_layout(tmp_path)  # no family guessed: the architecture is unknown
