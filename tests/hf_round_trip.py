"""The conversion scripts' round trip, shared by the families' tests: a Hugging Face folder ->
convert_from_hf (the family picked by model_type) -> our checkpoint, whose model computes the
Hugging Face logits -> convert_to_hf (the family the checkpoint records) -> the same tensors
bit for bit, which transformers loads and computes the same logits with."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def script(name: str):
    """scripts/<name>.py as a module (the scripts folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def round_trip(hf, tmp_path: Path, tokens: torch.Tensor, load, tied: bool = False):
    """Runs the round trip of `hf` (a float32 transformers model) in `tmp_path`; `load(folder)`
    loads the exported folder in transformers. Returns (our family spec, its args, the
    reloaded transformers model) for the family's own checks."""
    from checkpoint.hf import model_from_layout, read_dcp_model, read_hf_weights

    hf.save_pretrained(tmp_path / "hf")
    assert script("convert_from_hf").main([str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    ckpt = tmp_path / "dcp" / "step-0"
    spec, args = model_from_layout(ckpt)
    ours = spec.model_cls(args).eval()
    ours.init_buffers("cpu")
    ours.load_state_dict(read_dcp_model(ckpt))
    with torch.no_grad():
        want = hf(tokens).logits
        torch.testing.assert_close(ours(tokens), want, rtol=1e-4, atol=1e-4)
    assert script("convert_to_hf").main([str(ckpt), str(tmp_path / "back")]) == 0
    original, back = read_hf_weights(tmp_path / "hf"), read_hf_weights(tmp_path / "back")
    if tied:
        original.setdefault("lm_head.weight", original["model.embed_tokens.weight"])
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)
    again = load(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, want, rtol=0, atol=0)
    return spec, args, again
