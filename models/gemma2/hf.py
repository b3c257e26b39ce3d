"""Gemma 2 <-> Hugging Face `Gemma2ForCausalLM`: parameter names and config.json fields.

HF's Gemma 2 rotates the two halves of each head (rotate-half RoPE), as this model does, so
the weights are only renamed (the shared helpers, models/hf_names.py). Mind the names: HF's
`post_attention_layernorm` is the norm *after* attention (ours `post_attention_norm`), not the
pre-MLP norm it is in Llama and Qwen3 (that one is `pre_feedforward_layernorm`, ours
`ffn_norm`). The (1 + weight) norms are stored as HF stores them (the weight, without the 1).
"""

from __future__ import annotations

import torch

from models import hf_names
from models.gemma2.model import Gemma2Args
from models.gemma_blocks import GELU_TANH, HF_NORMS_AND_MLP

# Inside block i: layers.{i}.<ours> <-> model.layers.{i}.<HF>: the attention without QK-norms,
# then Gemma's norms and MLP (models/gemma_blocks.py)
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    **HF_NORMS_AND_MLP,
}
ACTIVATION = GELU_TANH


_NAMES = hf_names.Renaming(_BLOCK)
to_hf_name, from_hf_name, hf_tensor = _NAMES.to_hf_name, _NAMES.from_hf_name, _NAMES.hf_tensor
to_hf, from_hf = _NAMES.to_hf, _NAMES.from_hf


def layer_types(args: Gemma2Args) -> list[str]:
    return [
        "sliding_attention" if args.sliding(i) else "full_attention" for i in range(args.n_layers)
    ]


def hf_config(args: Gemma2Args) -> dict:
    """config.json fields of the equivalent `Gemma2ForCausalLM`."""
    return {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        **hf_names.attention_config(args),
        "intermediate_size": args.ffn_dim,
        "query_pre_attn_scalar": args.query_pre_attn_scalar,
        "attn_logit_softcapping": args.attn_softcap,
        "final_logit_softcapping": args.final_softcap,
        "sliding_window": args.sliding_window,
        "layer_types": layer_types(args),
        "hidden_activation": ACTIVATION,
        "hidden_act": ACTIVATION,
        "attention_dropout": 0.0,
    }


def config_with_dtype(args: Gemma2Args, dtype: torch.dtype) -> dict:
    return {**hf_config(args), "torch_dtype": str(dtype).removeprefix("torch.")}


def _problems(config: dict, args: Gemma2Args) -> list[str]:
    """What of a config.json this model cannot reproduce."""
    problems = []
    if config.get("attention_bias"):
        problems.append("attention_bias = true (this attention has no biases)")
    if config.get("attention_dropout"):
        problems.append(f"attention_dropout = {config['attention_dropout']} (no dropout here)")
    if config.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention = true (this attention is causal)")
    rope = {**(config.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        problems.append(f"rope_type = {rope_type!r} (only unscaled RoPE is implemented)")
    act = config.get("hidden_activation") or config.get("hidden_act") or ACTIVATION
    if act != ACTIVATION:
        problems.append(f"hidden_activation = {act!r} (the MLP is GeGLU with {ACTIVATION})")
    types = config.get("layer_types")
    if args.sliding_window is not None and types is not None and types != layer_types(args):
        problems.append(
            f"layer_types = {types} (here the even-indexed layers slide, the odd ones do not)"
        )
    return problems


def args_from_hf_config(config: dict) -> Gemma2Args:
    shape = hf_names.attention_args(config)  # the fields Qwen3 reads; Gemma's defaults where
    shape["tie_embeddings"] = config.get("tie_word_embeddings", True)  # config.json has none
    if not (config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")):
        shape["rope_theta"] = Gemma2Args.rope_theta
    args = Gemma2Args(
        **shape,
        ffn_dim=config["intermediate_size"],
        query_pre_attn_scalar=config["query_pre_attn_scalar"],
        attn_softcap=config.get("attn_logit_softcapping"),
        final_softcap=config.get("final_logit_softcapping"),
        sliding_window=config.get("sliding_window"),
    )
    hf_names.refuse(_problems(config, args))
    return args
