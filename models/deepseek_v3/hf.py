"""DeepSeek-V3 <-> Hugging Face `DeepseekV3ForCausalLM`: parameter names and config.json fields.

Our tensors have Hugging Face's layouts (the rotated query and key parts in interleaved pairs,
as transformers' `rope_interleave`), so they are renamed only: latent attention's projections
and norms (`wq_a` as `self_attn.q_a_proj`, `q_norm` as `q_a_layernorm`, `wkv_a` as
`kv_a_proj_with_mqa`, `kv_norm` as `kv_a_layernorm`, ...), the dense blocks' SwiGLU as
`mlp.{gate,up,down}_proj`, the router as `mlp.gate` with the aux-loss-free bias as its
`e_score_correction_bias`, the shared experts as `mlp.shared_experts`, and the routed experts in
the published per-expert form (models/moe_hf.py).

Multi-token prediction (models/mtp.py) is stored as the published checkpoint stores it: module
k as layer `num_hidden_layers + k` (`model.layers.61` of the 671B), its block under the block
names, `enorm`, `hnorm`, `eh_proj`, and its final norm as `shared_head.norm`; the layer's
`embed_tokens` and `shared_head.head` are copies of the main model's (shared here: dropped on
import, not written on export), and `num_nextn_predict_layers` is the depth. A checkpoint's
layers past the depth asked for are dropped. FP8 weights (`weight_scale_inv`) are refused with
the fix (dequantize to bfloat16 first).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from models import hf_names, moe_hf
from models.contract import HFTensor
from models.deepseek_v3.model import DeepSeekV3Args

_FFN = moe_hf.EXPERT  # a SwiGLU's projections, ours -> HF (dense, shared and routed experts)
_NAMES = hf_names.Renaming(
    {
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        **{f"feed_forward.{w}.weight": f"mlp.{p}.weight" for w, p in _FFN.items()},
        "moe.router.weight": "mlp.gate.weight",
        "moe.expert_bias": "mlp.gate.e_score_correction_bias",
        **{f"moe.shared_experts.{w}.weight": f"mlp.shared_experts.{p}.weight"
           for w, p in _FFN.items()},
        **{f"{n}.weight": f"{n}.weight" for n in ("enorm", "hnorm", "eh_proj")},
        "norm.weight": "shared_head.norm.weight",  # a multi-token-prediction module's own
    }
)  # fmt: skip
_MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "norm.weight")
_MTP = re.compile(r"mtp\.(\d+)\.(?:block\.)?(.+)")
_AS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the main model's, copied


def _as_layer(name: str, args: DeepSeekV3Args) -> str:
    """Ours -> the block name of its checkpoint layer: module k's `mtp.k.block.X` and
    `mtp.k.enorm.weight` as `layers.{n_layers + k}.X` and `layers.{n_layers + k}.enorm.weight`."""
    m = _MTP.fullmatch(name)
    return f"layers.{args.n_layers + int(m.group(1))}.{m.group(2)}" if m else name


def _from_layer(name: str, args: DeepSeekV3Args) -> str:
    """The inverse of `_as_layer`."""
    m = _AS_LAYER.fullmatch(name)
    if m is None or int(m.group(1)) < args.n_layers:
        return name
    k, rest = int(m.group(1)) - args.n_layers, m.group(2)
    return f"mtp.{k}.{rest}" if rest in _MTP_OWN else f"mtp.{k}.block.{rest}"


def to_hf_name(name: str, args: DeepSeekV3Args) -> str:
    return _NAMES.to_hf_name(_as_layer(name, args))


def from_hf_name(name: str, args: DeepSeekV3Args) -> str:
    return _from_layer(_NAMES.from_hf_name(name), args)


def hf_tensor(name: str, args: DeepSeekV3Args) -> HFTensor:
    """Where our tensor `name` is in HF files: the routed experts one tensor per expert, the
    rest renamed."""
    name = _as_layer(name, args)
    if m := moe_hf.OURS.fullmatch(name):
        return moe_hf.expert_tensor(m.group(1), m.group(2), args.n_experts)
    return _NAMES.hf_tensor(name, args)


def to_hf(sd: dict[str, torch.Tensor], args: DeepSeekV3Args) -> dict[str, torch.Tensor]:
    """Our full state dict -> the on-disk Hugging Face tensors (the experts as views of ours)."""
    out = {}
    for name, t in sd.items():
        name = _as_layer(name, args)
        if m := moe_hf.OURS.fullmatch(name):
            out.update(moe_hf.split_experts(m.group(1), m.group(2), t))
        else:
            out[_NAMES.to_hf_name(name)] = t
    return out


def from_hf(hf: dict[str, torch.Tensor], args: DeepSeekV3Args) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (bfloat16 or wider), per-expert or fused, -> ours; of the layers
    past `n_layers` (multi-token prediction) the first `mtp_depth`, less their copies of the
    embeddings and head."""
    quantized = sorted(n for n in hf if n.endswith("weight_scale_inv"))
    if quantized:
        raise ValueError(
            f"{quantized[0]} and {len(quantized) - 1} more are the scales of FP8 weights: load "
            "the model in transformers with FineGrainedFP8Config(dequantize=True) and "
            "save_pretrained it in bfloat16 (or cast it with DeepSeek's fp8_cast_bf16.py), then "
            "convert that folder"
        )
    layers = args.n_layers + args.mtp_depth
    kept = {n: t for n, t in hf.items() if not (m := _LAYER.fullmatch(n))
            or (int(m.group(1)) < layers and m.group(2) not in _SHARED)}  # fmt: skip
    out, rest = moe_hf.experts_from_hf(kept, args.n_experts, args.moe_ffn_dim)
    out.update(_NAMES.from_hf(rest, args))
    return {_from_layer(n, args): t for n, t in out.items()}


def args_for_files(args: DeepSeekV3Args, names: set[str]) -> DeepSeekV3Args:
    """config.json's `num_nextn_predict_layers` counts the prediction layers of DeepSeek's
    checkpoints, but transformers writes 1 by default and saves none: the depth is the number
    of those layers the files hold."""
    held = 0
    while held < args.mtp_depth and f"model.layers.{args.n_layers + held}.eh_proj.weight" in names:
        held += 1
    return dataclasses.replace(args, mtp_depth=held)


# ---------------------------------------------------------------------------- config.json
def _rope(config: dict) -> dict:
    return {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}


def args_from_hf_config(config: dict) -> DeepSeekV3Args:
    """DeepSeekV3Args of a `DeepseekV3ForCausalLM` config.json; refuses what this model lacks."""
    rope = _rope(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = []
    if config.get("quantization_config"):
        problems.append("quantization_config is set (FP8 weights; see models/deepseek_v3/hf.py)")
    if rope_type not in ("yarn", "default"):
        problems.append(f"rope_type = {rope_type!r} (DeepSeek-V3 here uses YaRN or none)")
    if not config.get("rope_interleave", True):
        problems.append("rope_interleave = false (this model rotates interleaved pairs)")
    if config.get("attention_bias"):
        problems.append("attention_bias = true (latent attention here has no biases)")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {config['hidden_act']!r} (the FFNs are SwiGLU)")
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func = {config['scoring_func']!r} (transformers' is sigmoid)")
    hf_names.refuse(problems)
    yarn = rope_type == "yarn"
    nope, rot = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    return DeepSeekV3Args(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_attention_heads"],
        head_dim=nope + rot,
        vocab_size=config["vocab_size"],
        norm_eps=config["rms_norm_eps"],
        rope_theta=config.get("rope_theta") or rope.get("rope_theta", 10_000.0),
        tie_embeddings=config.get("tie_word_embeddings", False),
        max_seq_len=config.get("max_position_embeddings", 4096),
        q_lora_rank=config.get("q_lora_rank") or 0,
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rot,
        v_head_dim=config["v_head_dim"],
        ffn_dim=config["intermediate_size"],
        n_dense_layers=config.get("first_k_dense_replace", 0),
        n_experts=config["n_routed_experts"],
        top_k=config["num_experts_per_tok"],
        moe_ffn_dim=config["moe_intermediate_size"],
        n_shared_experts=config.get("n_shared_experts") or 0,
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        moe_n_groups=config.get("n_group", 1),
        moe_topk_groups=config.get("topk_group", 1),
        moe_route_scale=config.get("routed_scaling_factor", 1.0),
        rope_factor=rope["factor"] if yarn else 1.0,
        rope_old_context=rope["original_max_position_embeddings"] if yarn else 4096,
        rope_beta_fast=rope.get("beta_fast") or 32.0,
        rope_beta_slow=rope.get("beta_slow") or 1.0,
        rope_mscale=rope.get("mscale") or 1.0,
        rope_mscale_all_dim=rope.get("mscale_all_dim") or 1.0,
        mtp_depth=config.get("num_nextn_predict_layers", config.get("num_mtp_layers")) or 0,
    )


def config_with_dtype(args: DeepSeekV3Args, dtype: torch.dtype) -> dict:
    """config.json of the equivalent `DeepseekV3ForCausalLM` (its multi-token-prediction layers
    as `num_nextn_predict_layers`)."""
    rope = {"rope_type": "default"}
    if args.rope_factor != 1.0:
        rope = {
            "rope_type": "yarn",
            "factor": args.rope_factor,
            "original_max_position_embeddings": args.rope_old_context,
            "beta_fast": args.rope_beta_fast,
            "beta_slow": args.rope_beta_slow,
            "mscale": args.rope_mscale,
            "mscale_all_dim": args.rope_mscale_all_dim,
        }
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "head_dim": args.qk_rope_head_dim,  # transformers' name for the rotated part's size
        "v_head_dim": args.v_head_dim,
        "intermediate_size": args.ffn_dim,
        "first_k_dense_replace": args.n_dense_layers,
        "n_routed_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_ffn_dim,
        "n_shared_experts": args.n_shared_experts,
        "norm_topk_prob": args.norm_topk_prob,
        "n_group": args.moe_n_groups,
        "topk_group": args.moe_topk_groups,
        "routed_scaling_factor": args.moe_route_scale,
        "num_nextn_predict_layers": args.mtp_depth,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,  # older transformers; newer read rope_parameters
        "rope_scaling": None if args.rope_factor == 1.0 else rope,
        "rope_parameters": {**rope, "rope_theta": args.rope_theta},
        "rope_interleave": True,
        "tie_word_embeddings": args.tie_embeddings,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
