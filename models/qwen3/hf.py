"""Qwen3 <-> Hugging Face `Qwen3ForCausalLM`: parameter names and config.json fields.

Hugging Face's Qwen3 rotates the two halves of each head (rotate-half RoPE), as this model
does, so the weights need no permutation, only new names. The attention, norm and embedding
names and the config.json fields they share are also Qwen3-MoE's (`models/qwen3_moe/hf.py`).
"""

from __future__ import annotations

import re

import torch

from models.contract import HFTensor
from models.qwen3.model import Qwen3Args

# Inside block i, what Qwen3 and Qwen3-MoE share: layers.{i}.<ours> <-> model.layers.{i}.<HF>
ATTENTION = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_BLOCK = {
    **ATTENTION,
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_ROOT = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_ROOT_BACK = {v: k for k, v in _ROOT.items()}


def to_hf_name(name: str, block: dict[str, str] = _BLOCK) -> str:
    """Hugging Face's name for one of ours; `block`: the names inside a block (ours -> HF)."""
    if name in _ROOT:
        return _ROOT[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in block:
        raise KeyError(f"no Hugging Face name for parameter '{name}'")
    return f"model.layers.{m.group(1)}.{block[m.group(2)]}"


def from_hf_name(name: str, block_back: dict[str, str] = _BLOCK_BACK) -> str:
    """Our name for a Hugging Face tensor; `block_back`: the names inside a block (HF -> ours)."""
    if name in _ROOT_BACK:
        return _ROOT_BACK[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in block_back:
        raise KeyError(f"unknown Hugging Face tensor '{name}'")
    return f"layers.{m.group(1)}.{block_back[m.group(2)]}"


def hf_tensor(name: str, args, block: dict[str, str] = _BLOCK) -> HFTensor:
    """Where our tensor `name` is in HF files: renamed only (a tied output matrix is the
    embedding's when lm_head.weight is absent)."""
    tied = "model.embed_tokens.weight" if name == "output.weight" and args.tie_embeddings else None
    return HFTensor((to_hf_name(name, block),), tied=tied)


def to_hf(sd: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
    """Our full state dict -> Hugging Face tensors (the weights need no permutation)."""
    return {to_hf_name(name): t for name, t in sd.items()}


def from_hf(
    hf: dict[str, torch.Tensor], args, block_back: dict[str, str] = _BLOCK_BACK
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> ours; a tied model's output weight is the embedding matrix."""
    out = {from_hf_name(name, block_back): t for name, t in hf.items() if "rotary_emb" not in name}
    if "output.weight" not in out and args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def config_with_dtype(args: Qwen3Args, dtype: torch.dtype) -> dict:
    return {**hf_config(args), "torch_dtype": str(dtype).removeprefix("torch.")}


def attention_config(args) -> dict:
    """The config.json fields of the shape Qwen3 and Qwen3-MoE share (all but the FFN)."""
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,  # older transformers; newer read rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": args.tie_embeddings,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
    }


def hf_config(args: Qwen3Args) -> dict:
    """config.json fields of the equivalent `Qwen3ForCausalLM`."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **attention_config(args),
        "intermediate_size": args.ffn_dim,
    }


def attention_args(config: dict) -> dict:
    """The args fields Qwen3 and Qwen3-MoE share, from a config.json."""
    rope = config.get("rope_parameters") or {}
    return dict(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        vocab_size=config["vocab_size"],
        norm_eps=config["rms_norm_eps"],
        rope_theta=config.get("rope_theta") or rope.get("rope_theta", 1_000_000.0),
        tie_embeddings=config.get("tie_word_embeddings", False),
        max_seq_len=config.get("max_position_embeddings", 4096),
    )


def attention_problems(config: dict) -> list[str]:
    """What of a config.json's attention this model cannot reproduce (Qwen3 and Qwen3-MoE)."""
    problems = []
    if config.get("attention_bias"):
        problems.append("attention_bias = true (this attention has no biases)")
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        problems.append("sliding-window attention is in use (this attention is full causal)")
    rope = {**(config.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        problems.append(f"rope_type = {rope_type!r} (only unscaled RoPE is implemented)")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {config['hidden_act']!r} (the FFN is SwiGLU)")
    return problems


def refuse(problems: list[str]) -> None:
    if problems:
        raise ValueError("config.json cannot be reproduced: " + "; ".join(problems))


def args_from_hf_config(config: dict) -> Qwen3Args:
    refuse(attention_problems(config))
    return Qwen3Args(**attention_args(config), ffn_dim=config["intermediate_size"])
