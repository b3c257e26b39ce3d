"""gpt-oss <-> Hugging Face `GptOssForCausalLM`: parameter names and config.json fields.

Our tensors have Hugging Face's layouts (rotate-half heads, the experts' fused and interleaved
`gate_up_proj` [E, dim, 2F]), so they are renamed only: the attention and norms as the shared
decoder's (`models/hf_names.py`) with the projections' biases, `attention.core.sinks` as
`self_attn.sinks`, `moe.router` as `mlp.router`, `moe.experts.*` as `mlp.experts.*`.
The published checkpoints store the experts in MXFP4 (`*_blocks`, `*_scales`): those are
refused with the fix (load them dequantized in transformers and save in bfloat16 first).
`expert_bias` (the aux-loss-free balancing bias) has no Hugging Face counterpart: left out of
an export (with a warning when non-zero), zero on import.
"""

from __future__ import annotations

import re
import warnings

import torch

from models import hf_names
from models.contract import HFTensor
from models.gpt_oss.model import GptOssArgs

_PROJECTIONS = {f"attention.w{p}.{kind}": f"self_attn.{p}_proj.{kind}"
                for p in "qkvo" for kind in ("weight", "bias")}  # fmt: skip
_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_NAMES = hf_names.Renaming(
    {
        **_PROJECTIONS,
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attention.core.sinks": "self_attn.sinks",
        "moe.router.weight": "mlp.router.weight",
        "moe.router.bias": "mlp.router.bias",
        **{f"moe.experts.{n}": f"mlp.experts.{n}" for n in _EXPERTS},
    }
)
_EXPERT_BIAS = re.compile(r"layers\.(\d+)\.moe\.expert_bias")
to_hf_name, from_hf_name = _NAMES.to_hf_name, _NAMES.from_hf_name


def hf_tensor(name: str, args: GptOssArgs) -> HFTensor:
    """Where our tensor `name` is in HF files: renamed, the balancing bias nowhere."""
    return HFTensor(()) if _EXPERT_BIAS.fullmatch(name) else _NAMES.hf_tensor(name, args)


def to_hf(sd: dict[str, torch.Tensor], args: GptOssArgs) -> dict[str, torch.Tensor]:
    """Our full state dict -> Hugging Face tensors (no expert_bias: see the module doc)."""
    biased = [n for n, t in sd.items() if _EXPERT_BIAS.fullmatch(n) and t.any()]
    if biased:
        warnings.warn(
            f"{', '.join(biased)} non-zero: Hugging Face's gpt-oss has no balancing bias, so "
            "the exported model chooses its experts without it",
            stacklevel=2,
        )
    return _NAMES.to_hf({n: t for n, t in sd.items() if not _EXPERT_BIAS.fullmatch(n)}, args)


def from_hf(hf: dict[str, torch.Tensor], args: GptOssArgs) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (bfloat16 or wider, not MXFP4) -> ours, expert_bias zero."""
    quantized = sorted(n for n in hf if n.endswith(("_blocks", "_scales")))
    if quantized:
        raise ValueError(
            f"{quantized[0]} and {len(quantized) - 1} more are MXFP4-quantized experts: load "
            "the model in transformers with Mxfp4Config(dequantize=True) and save_pretrained "
            "it in bfloat16, then convert that folder"
        )
    out = _NAMES.from_hf(hf, args)
    for i in range(args.n_layers):
        out[f"layers.{i}.moe.expert_bias"] = torch.zeros(args.n_experts)
    return out


# ---------------------------------------------------------------------------- config.json
def _layer_types(n_layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]


def args_from_hf_config(config: dict) -> GptOssArgs:
    """GptOssArgs of a `GptOssForCausalLM` config.json; refuses what this model lacks."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    problems = []
    if config.get("quantization_config"):
        problems.append("quantization_config is set (MXFP4 experts; see models/gpt_oss/hf.py)")
    if rope.get("rope_type", rope.get("type")) != "yarn":
        problems.append(f"rope_type = {rope.get('rope_type')!r} (gpt-oss here uses YaRN)")
    if config.get("layer_types") not in (None, _layer_types(config["num_hidden_layers"])):
        problems.append("layer_types does not alternate sliding (even) and full (odd) layers")
    if not config.get("attention_bias", True):
        problems.append("attention_bias = false (gpt-oss's projections have biases)")
    hf_names.refuse(problems)
    return GptOssArgs(
        **hf_names.attention_args(config),
        n_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        moe_ffn_dim=config["intermediate_size"],
        moe_aux_loss_coeff=config.get("router_aux_loss_coef", 0.001),
        sliding_window=config["sliding_window"],
        rope_factor=rope["factor"],
        rope_old_context=rope["original_max_position_embeddings"],
        rope_beta_fast=rope.get("beta_fast") or 32.0,
        rope_beta_slow=rope.get("beta_slow") or 1.0,
        rope_truncate=rope.get("truncate", True),  # transformers' default
        swiglu_alpha=config.get("swiglu_alpha", 1.702),
        swiglu_limit=config.get("swiglu_limit", 7.0),
    )


def config_with_dtype(args: GptOssArgs, dtype: torch.dtype) -> dict:
    """config.json of the equivalent `GptOssForCausalLM`."""
    yarn = {
        "rope_type": "yarn",
        "factor": args.rope_factor,
        "beta_fast": args.rope_beta_fast,
        "beta_slow": args.rope_beta_slow,
        "truncate": args.rope_truncate,
        "original_max_position_embeddings": args.rope_old_context,
    }
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **hf_names.attention_config(args),
        "attention_bias": True,
        "rope_scaling": yarn,  # older transformers; newer read rope_parameters
        "rope_parameters": {**yarn, "rope_theta": args.rope_theta},
        "sliding_window": args.sliding_window,
        "layer_types": _layer_types(args.n_layers),
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "intermediate_size": args.moe_ffn_dim,
        "swiglu_alpha": args.swiglu_alpha,
        "swiglu_limit": args.swiglu_limit,
        "router_aux_loss_coef": args.moe_aux_loss_coeff,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
