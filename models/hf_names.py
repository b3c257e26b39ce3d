"""Hugging Face names and config.json fields shared by the families of the shared decoder
shape (models/decoder_shape.py: Qwen3, Qwen3-MoE, Gemma 2, Gemma 3): the root tensors, the
attention and norm names inside a block, renaming both ways with a family's block map, and the
config.json fields of the shape. Hugging Face rotates the two halves of each head
(rotate-half RoPE), as the shared attention does, so the weights need no permutation, only
new names."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from models.contract import HFTensor

# Inside block i, the attention and its norms: layers.{i}.<ours> <-> model.layers.{i}.<HF>
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
ROOT = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ROOT_BACK = {v: k for k, v in ROOT.items()}


def to_hf_name(name: str, block: dict[str, str]) -> str:
    """Hugging Face's name for one of ours; `block`: the names inside a block (ours -> HF)."""
    if name in ROOT:
        return ROOT[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in block:
        raise KeyError(f"no Hugging Face name for parameter '{name}'")
    return f"model.layers.{m.group(1)}.{block[m.group(2)]}"


def from_hf_name(name: str, block_back: dict[str, str]) -> str:
    """Our name for a Hugging Face tensor; `block_back`: the names inside a block (HF -> ours)."""
    if name in _ROOT_BACK:
        return _ROOT_BACK[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in block_back:
        raise KeyError(f"unknown Hugging Face tensor '{name}'")
    return f"layers.{m.group(1)}.{block_back[m.group(2)]}"


def hf_tensor(name: str, args, block: dict[str, str]) -> HFTensor:
    """Where our tensor `name` is in HF files: renamed only (a tied output matrix is the
    embedding's when lm_head.weight is absent)."""
    tied = "model.embed_tokens.weight" if name == "output.weight" and args.tie_embeddings else None
    return HFTensor((to_hf_name(name, block),), tied=tied)


def from_hf(hf: dict[str, torch.Tensor], args, block_back: dict[str, str]) -> dict:
    """Hugging Face tensors -> ours; a tied model's output weight is the embedding matrix."""
    out = {from_hf_name(name, block_back): t for name, t in hf.items() if "rotary_emb" not in name}
    if "output.weight" not in out and args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def attention_config(args) -> dict:
    """The config.json fields of the shared decoder shape (all but the FFN)."""
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


def attention_args(config: dict) -> dict:
    """The shared decoder shape's args fields, from a config.json."""
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
    """What of a config.json's attention the shared QK-norm attention cannot reproduce."""
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


@dataclass(frozen=True)
class Renaming:
    """A family's renaming between our tensors and Hugging Face's (renamed only, no
    permutation), from its block map (ours -> HF); a family's hf.py binds these methods as its
    module functions."""

    block: dict[str, str]
    block_back: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_back", {v: k for k, v in self.block.items()})

    def to_hf_name(self, name: str) -> str:
        return to_hf_name(name, self.block)

    def from_hf_name(self, name: str) -> str:
        return from_hf_name(name, self.block_back)

    def hf_tensor(self, name: str, args) -> HFTensor:
        return hf_tensor(name, args, self.block)

    def to_hf(self, sd: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
        """Our full state dict -> Hugging Face tensors."""
        return {self.to_hf_name(name): t for name, t in sd.items()}

    def from_hf(self, hf: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
        """Hugging Face tensors -> ours; a tied model's output weight is the embedding matrix."""
        return from_hf(hf, args, self.block_back)
