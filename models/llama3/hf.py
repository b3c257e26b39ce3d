"""Llama 3 <-> Hugging Face `LlamaForCausalLM`: names, the Q/K RoPE row permutation, config.json.

This model rotates adjacent pairs (x[2i], x[2i+1]) of each head (Meta's interleaved RoPE,
`models/rope.py`); HF Llama rotates the halves (x[i], x[i + head_dim/2]). The same attention is
obtained by reordering the rows of wq and wk within each head: HF row r*head_dim/2 + i is
Meta row 2i + r. Everything else maps one to one by name.
"""

from __future__ import annotations

from functools import partial

import torch

from models.contract import HFTensor
from models.llama3.model import ModelArgs


class HFConfigError(ValueError):
    """A config.json this model cannot reproduce."""


# (meshtrain suffix, HF suffix) inside layer i: layers.{i}.<a>  <->  model.layers.{i}.<b>
LAYER_KEYS = [
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("attention_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
]
TOP_KEYS = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
]
# Llama 3 frequency scaling, the only one `rope_frequencies` implements (factor 8 in Llama 3.1,
# 32 in Llama 3.2; the factor is read from and written to config.json).
LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def to_hf_name(name: str) -> str:
    for ours, theirs in TOP_KEYS:
        if name == ours:
            return theirs
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers":
        for ours, theirs in LAYER_KEYS:
            if parts[2] == ours:
                return f"model.layers.{parts[1]}.{theirs}"
    raise KeyError(f"no Hugging Face name for parameter '{name}'")


def from_hf_name(name: str) -> str | None:
    """Our name for an HF tensor; None for tensors that carry no weights (rotary caches)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    for ours, theirs in TOP_KEYS:
        if name == theirs:
            return ours
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        for ours, theirs in LAYER_KEYS:
            if parts[3] == theirs:
                return f"layers.{parts[2]}.{ours}"
    raise KeyError(f"unknown Hugging Face Llama tensor '{name}'")


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """wq/wk rows: Meta's interleaved pairs -> HF's rotate-half order (per head)."""
    out_dim, in_dim = w.shape
    return (
        w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)
    )


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `permute_to_hf`."""
    out_dim, in_dim = w.shape
    return (
        w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)
    )


def _heads_for(name: str, args: ModelArgs) -> int | None:
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def hf_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The HF row of each of our wq/wk rows: our row h*head_dim + 2i + r is HF's
    h*head_dim + r*head_dim/2 + i (`permute_to_hf`, row by row, so a slice maps to a slice)."""
    head, within = rows // head_dim, rows % head_dim
    return head * head_dim + (within % 2) * (head_dim // 2) + within // 2


def hf_tensor(name: str, args: ModelArgs) -> HFTensor:
    """Where our tensor `name` is in HF files (the per-tensor form of `meta_to_hf`)."""
    if name == "output.weight" and args.tie_embeddings:
        return HFTensor((to_hf_name(name),), tied="model.embed_tokens.weight")
    if _heads_for(name, args):
        return HFTensor((to_hf_name(name),), rows=partial(hf_rows, head_dim=args.head_dim))
    return HFTensor((to_hf_name(name),))


def hf_to_meta(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF tensors -> ours; a tied model's output weight is the embedding matrix."""
    out = {}
    for name, t in hf.items():
        ours = from_hf_name(name)
        if ours is None:
            continue
        heads = _heads_for(ours, args)
        out[ours] = permute_from_hf(t, heads).contiguous() if heads else t
    if "output.weight" not in out and args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"].clone()
    return out


def meta_to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        heads = _heads_for(name, args)
        out[to_hf_name(name)] = permute_to_hf(t, heads).contiguous() if heads else t
    return out


# ------------------------------------------------------------------------------ config.json
def args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs reproducing an HF Llama config.json (its FFN width exactly)."""
    if cfg.get("model_type", "llama") != "llama":
        raise HFConfigError(
            f"config.json model_type = {cfg.get('model_type')!r}: only "
            "Llama checkpoints can be converted."
        )
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, dim // n_heads):
        raise HFConfigError(
            f"config.json head_dim = {cfg['head_dim']} differs from "
            f"hidden_size / num_attention_heads = {dim // n_heads}."
        )
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise HFConfigError(f"config.json {flag} = true: this model has no biases.")
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaled = rope_type == "llama3"
    fixed = {k: v for k, v in LLAMA3_ROPE.items() if k != "factor"}
    if scaled and any(float(rope.get(k, -1)) != v for k, v in fixed.items()):
        raise HFConfigError(
            f"config.json rope scaling {rope} differs from Llama 3's {fixed} (any factor), "
            "the only scaling this model implements."
        )
    if rope_type not in ("default", "llama3"):
        raise HFConfigError(f"config.json rope_type = {rope_type!r} is not supported.")
    hidden = cfg["intermediate_size"]
    base = int(2 * (4 * dim) / 3)
    # multiple_of = the width itself and a multiplier landing just below it reproduce it
    args = ModelArgs(
        dim=dim,
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        vocab_size=cfg["vocab_size"],
        multiple_of=hidden,
        ffn_dim_multiplier=None if hidden == base else hidden / base,
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=float(theta),
        use_scaled_rope=scaled,
        rope_scaling_factor=float(rope.get("factor", LLAMA3_ROPE["factor"])),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_seq_len=cfg.get("max_position_embeddings", 8192),
    )
    if args.ffn_hidden_dim != hidden:
        raise HFConfigError(f"cannot express intermediate_size = {hidden} as ModelArgs")
    return args


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype) -> dict:
    rope_scaling = None
    if args.use_scaled_rope:
        rope_scaling = {"rope_type": "llama3", **LLAMA3_ROPE, "factor": args.rope_scaling_factor}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
