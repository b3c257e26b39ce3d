"""Qwen3-MoE <-> Hugging Face `Qwen3MoeForCausalLM`: parameter names and config.json fields.

Attention, norms and embeddings are named as the dense Qwen3's (`models/hf_names.py`). The
experts are written in the on-disk format of the published checkpoints, one linear per expert
and projection, and read in that form or transformers' fused one (the shared
`models/moe_hf.py`); the router is `model.layers.{i}.mlp.gate.weight`.

`expert_bias` (the aux-loss-free balancing bias) has no Hugging Face counterpart: it is left
out of an export (with a warning when non-zero: the exported model then chooses its experts
without it) and zero on import.
"""

from __future__ import annotations

import re
import warnings

import torch

from models import hf_names, moe_hf
from models.contract import HFTensor
from models.qwen3_moe.model import Qwen3MoEArgs

_BLOCK = {**hf_names.ATTENTION, "moe.router.weight": "mlp.gate.weight"}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_EXPERT_BIAS = re.compile(r"layers\.(\d+)\.moe\.expert_bias")


def hf_tensor(name: str, args: Qwen3MoEArgs) -> HFTensor:
    """Where our tensor `name` is in HF files: the experts stacked from one tensor per expert,
    the balancing bias nowhere (zero on import), the rest renamed as Qwen3's."""
    if m := moe_hf.OURS.fullmatch(name):
        return moe_hf.expert_tensor(m.group(1), m.group(2), args.n_experts)
    if _EXPERT_BIAS.fullmatch(name):
        return HFTensor(())
    return hf_names.hf_tensor(name, args, _BLOCK)


# ------------------------------------------------------------------------------- export
def to_hf(sd: dict[str, torch.Tensor], args: Qwen3MoEArgs) -> dict[str, torch.Tensor]:
    """Our full state dict -> the on-disk Hugging Face tensors (the experts as views of ours)."""
    out, biased = {}, []
    for name, t in sd.items():
        if m := moe_hf.OURS.fullmatch(name):
            out.update(moe_hf.split_experts(m.group(1), m.group(2), t))
        elif m := _EXPERT_BIAS.fullmatch(name):
            if t.any():
                biased.append(m.group(1))
        else:
            out[hf_names.to_hf_name(name, _BLOCK)] = t
    if biased:
        warnings.warn(
            f"layers {', '.join(biased)} have a non-zero expert_bias, which Hugging Face's "
            "Qwen3-MoE lacks: the exported model chooses its experts without it",
            stacklevel=2,
        )
    return out


# ------------------------------------------------------------------------------- import
def from_hf(hf: dict[str, torch.Tensor], args: Qwen3MoEArgs) -> dict[str, torch.Tensor]:
    """Hugging Face tensors, per-expert (on disk) or fused (transformers' in-memory names),
    -> our state dict, with a zero `expert_bias` per layer."""
    out, rest = moe_hf.experts_from_hf(hf, args.n_experts, args.moe_ffn_dim)
    out.update(hf_names.from_hf(rest, args, _BLOCK_BACK))
    for i in range(args.n_layers):
        out[f"layers.{i}.moe.expert_bias"] = torch.zeros(args.n_experts)
    return out


# ---------------------------------------------------------------------------- config.json
def args_from_hf_config(config: dict) -> Qwen3MoEArgs:
    """Qwen3MoEArgs of a `Qwen3MoeForCausalLM` config.json; refuses what this model lacks."""
    hf_names.refuse(hf_names.attention_problems(config) + moe_problems(config))
    return Qwen3MoEArgs(
        **hf_names.attention_args(config),
        n_experts=config.get("num_experts", config.get("num_local_experts", 0)),
        top_k=config["num_experts_per_tok"],
        moe_ffn_dim=config["moe_intermediate_size"],
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),  # transformers' default
        moe_aux_loss_coeff=config.get("router_aux_loss_coef", 0.001),
    )


def moe_problems(config: dict) -> list[str]:
    """Every block here is sparse: dense blocks between them cannot be reproduced."""
    problems = []
    if config.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers = {config['mlp_only_layers']} (dense blocks)")
    if config.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step = {config['decoder_sparse_step']} (dense blocks)")
    return problems


def hf_config(args: Qwen3MoEArgs) -> dict:
    """config.json fields of the equivalent `Qwen3MoeForCausalLM`."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **hf_names.attention_config(args),
        "num_experts": args.n_experts,  # the published configs' key (transformers 5 writes
        "num_experts_per_tok": args.top_k,  # num_local_experts, and reads both)
        "moe_intermediate_size": args.moe_ffn_dim,
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        # the width of dense blocks, of which there are none; the published configs' value
        "intermediate_size": args.moe_ffn_dim * args.top_k,
        "router_aux_loss_coef": args.moe_aux_loss_coeff,
        "use_sliding_window": False,
    }


def config_with_dtype(args: Qwen3MoEArgs, dtype: torch.dtype) -> dict:
    return {**hf_config(args), "torch_dtype": str(dtype).removeprefix("torch.")}
