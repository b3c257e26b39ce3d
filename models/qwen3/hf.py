"""Qwen3 <-> Hugging Face `Qwen3ForCausalLM`: parameter names and config.json fields.

Hugging Face's Qwen3 rotates the two halves of each head (rotate-half RoPE), as this model
does, so the weights need no permutation, only new names: the shared helpers of
`models/hf_names.py` with Qwen3's block map.
"""

from __future__ import annotations

import torch

from models import hf_names
from models.qwen3.model import Qwen3Args

# Inside block i: layers.{i}.<ours> <-> model.layers.{i}.<HF>
_BLOCK = {
    **hf_names.ATTENTION,
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}


_NAMES = hf_names.Renaming(_BLOCK)
to_hf_name, from_hf_name, hf_tensor = _NAMES.to_hf_name, _NAMES.from_hf_name, _NAMES.hf_tensor
to_hf, from_hf = _NAMES.to_hf, _NAMES.from_hf


def config_with_dtype(args: Qwen3Args, dtype: torch.dtype) -> dict:
    return {**hf_config(args), "torch_dtype": str(dtype).removeprefix("torch.")}


def hf_config(args: Qwen3Args) -> dict:
    """config.json fields of the equivalent `Qwen3ForCausalLM`."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **hf_names.attention_config(args),
        "intermediate_size": args.ffn_dim,
    }


def args_from_hf_config(config: dict) -> Qwen3Args:
    hf_names.refuse(hf_names.attention_problems(config))
    return Qwen3Args(**hf_names.attention_args(config), ffn_dim=config["intermediate_size"])
