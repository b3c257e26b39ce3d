"""Gemma 3 (text) <-> Hugging Face `Gemma3ForCausalLM` (model_type "gemma3_text"): parameter
names and config.json fields.

The weights need no change: Hugging Face's Gemma 3 rotates the two halves of each head, as this
model does, and keeps the norms' zero-centred weights (the norm multiplies by 1 + weight) as
this model does. Only the names differ; the name helpers are the shared ones
(`models/hf_names.py`) with Gemma's block names. The published 4B, 12B and 27B checkpoints are the multimodal
`Gemma3ForConditionalGeneration` (model_type "gemma3"); their text part is read here as a
`Gemma3ForCausalLM` checkpoint once extracted (config.json's `text_config`, tensors without the
`language_model` prefix), which this adapter does not do itself.
"""

from __future__ import annotations

import torch

from models import hf_names
from models.gemma3.model import Gemma3Args
from models.gemma_blocks import GELU_TANH, HF_NORMS_AND_MLP

# Inside block i: layers.{i}.<ours> <-> model.layers.{i}.<HF>: q/k/v/o, the QK-norms and
# input_layernorm as Qwen3's, then Gemma's norms and MLP (models/gemma_blocks.py)
_BLOCK = {**hf_names.ATTENTION, **HF_NORMS_AND_MLP}
ACTIVATION = GELU_TANH
SLIDING, FULL = "sliding_attention", "full_attention"


_NAMES = hf_names.Renaming(_BLOCK)
to_hf_name, from_hf_name, hf_tensor = _NAMES.to_hf_name, _NAMES.from_hf_name, _NAMES.hf_tensor
to_hf, from_hf = _NAMES.to_hf, _NAMES.from_hf


def layer_types(args: Gemma3Args) -> list[str]:
    return [FULL if args.is_global(i) else SLIDING for i in range(args.n_layers)]


def hf_config(args: Gemma3Args) -> dict:
    """config.json fields of the equivalent `Gemma3ForCausalLM` (the current `rope_parameters`
    per layer type, and the older `rope_theta`, `rope_local_base_freq` and `rope_scaling`)."""
    scaled = args.rope_scaling_factor != 1.0
    full = {"rope_type": "linear", "factor": args.rope_scaling_factor} if scaled else {}
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_activation": ACTIVATION,
        "rms_norm_eps": args.norm_eps,
        "query_pre_attn_scalar": args.query_pre_attn_scalar,
        "sliding_window": args.sliding_window,
        "sliding_window_pattern": args.sliding_window_pattern,
        "layer_types": layer_types(args),
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": args.rope_local_theta},
            FULL: {"rope_type": "default", "rope_theta": args.rope_theta, **full},
        },
        "rope_theta": args.rope_theta,
        "rope_local_base_freq": args.rope_local_theta,
        "rope_scaling": full or None,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": args.tie_embeddings,
        "max_position_embeddings": args.max_seq_len,
    }


def config_with_dtype(args: Gemma3Args, dtype: torch.dtype) -> dict:
    return {**hf_config(args), "torch_dtype": str(dtype).removeprefix("torch.")}


def _pattern(config: dict, n_layers: int) -> tuple[int, list[str]]:
    """The sliding-window pattern of the config's `layer_types` (every p-th layer global),
    or a problem when they follow none."""
    types = config.get("layer_types")
    default = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
    if not types:
        return default, []
    globals_ = [i for i, kind in enumerate(types) if kind == FULL]
    pattern = globals_[0] + 1 if globals_ else max(default, n_layers + 1)
    want = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n_layers)]
    if list(types) != want:
        return pattern, [
            f"layer_types {types} do not repeat {pattern - 1} sliding-window layers and one "
            "global layer (the layouts this model builds)"
        ]
    return pattern, []


def _rope(config: dict) -> tuple[dict, dict]:
    """(full-attention, sliding-attention) RoPE parameters, from either config.json style."""
    params = config.get("rope_parameters") or {}
    full = dict(params.get(FULL) or {})
    local = dict(params.get(SLIDING) or {})
    full.update(config.get("rope_scaling") or {})
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    return full, local


def problems(config: dict) -> list[str]:
    """What of a config.json this model cannot reproduce."""
    out = []
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            out.append(f"{key} = {config[key]} (this model does not soft-cap)")
    if config.get("attention_bias"):
        out.append("attention_bias = true (this attention has no biases)")
    if config.get("use_bidirectional_attention"):
        out.append("use_bidirectional_attention = true (this attention is causal)")
    if config.get("hidden_activation", ACTIVATION) != ACTIVATION:
        out.append(f"hidden_activation = {config['hidden_activation']!r} (the MLP is GeGLU, tanh)")
    full, local = _rope(config)
    for kind, rope, allowed in (
        (FULL, full, ("default", "linear")),
        (SLIDING, local, ("default",)),
    ):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in allowed:
            out.append(f"{kind} rope_type = {rope_type!r} (implemented: {', '.join(allowed)})")
    return out


def args_from_hf_config(config: dict) -> Gemma3Args:
    n_layers = config["num_hidden_layers"]
    pattern, bad = _pattern(config, n_layers)
    bad += problems(config)
    if bad:
        raise ValueError("config.json cannot be reproduced: " + "; ".join(bad))
    full, local = _rope(config)
    linear = full.get("rope_type", full.get("type", "default")) == "linear"
    return Gemma3Args(
        dim=config["hidden_size"],
        n_layers=n_layers,
        n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=full["rope_theta"],
        rope_local_theta=local["rope_theta"],
        rope_scaling_factor=float(full["factor"]) if linear else 1.0,
        sliding_window=config["sliding_window"],
        sliding_window_pattern=pattern,
        query_pre_attn_scalar=config.get("query_pre_attn_scalar", 256),
        tie_embeddings=config.get("tie_word_embeddings", True),
        max_seq_len=config.get("max_position_embeddings", 4096),
    )
