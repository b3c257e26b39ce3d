"""Qwen3-MoE <-> Hugging Face `Qwen3MoeForCausalLM`: parameter names and config.json fields.

Attention, norms and embeddings are named as the dense Qwen3's (`models/hf_names.py`). The
experts are written in the on-disk format of the published checkpoints, one linear per expert
and projection: `model.layers.{i}.mlp.experts.{j}.gate_proj.weight` (our `w1[j]`), `up_proj`
(`w3[j]`), `down_proj` (`w2[j]`), and the router as `model.layers.{i}.mlp.gate.weight`.
transformers 5 stacks those on load (its conversion mapping for qwen2_moe, which qwen3_moe
uses) into the fused `experts.gate_up_proj` [E, 2F, dim] (gate rows first) and
`experts.down_proj` [E, dim, F] of its in-memory model; both forms are read here.

`expert_bias` (the aux-loss-free balancing bias) has no Hugging Face counterpart: it is left
out of an export (with a warning when non-zero: the exported model then chooses its experts
without it) and zero on import.
"""

from __future__ import annotations

import re
import warnings

import torch

from models import hf_names
from models.contract import HFTensor
from models.qwen3_moe.model import Qwen3MoEArgs

_BLOCK = {**hf_names.ATTENTION, "moe.router.weight": "mlp.gate.weight"}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}  # ours -> HF projection
_EXPERT_BACK = {v: k for k, v in _EXPERT.items()}
_OURS_MOE = re.compile(r"layers\.(\d+)\.moe\.(experts\.w[123]|expert_bias)")
_PER_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
)
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def hf_tensor(name: str, args: Qwen3MoEArgs) -> HFTensor:
    """Where our tensor `name` is in HF files: the experts stacked from one tensor per expert,
    the balancing bias nowhere (zero on import), the rest renamed as Qwen3's."""
    m = _OURS_MOE.fullmatch(name)
    if m is None:
        return hf_names.hf_tensor(name, args, _BLOCK)
    if m.group(2) == "expert_bias":
        return HFTensor(())
    proj = _EXPERT[m.group(2)[-2:]]
    names = [
        f"model.layers.{m.group(1)}.mlp.experts.{j}.{proj}.weight" for j in range(args.n_experts)
    ]
    return HFTensor(tuple(names), stacked=True)


# ------------------------------------------------------------------------------- export
def to_hf(sd: dict[str, torch.Tensor], args: Qwen3MoEArgs) -> dict[str, torch.Tensor]:
    """Our full state dict -> the on-disk Hugging Face tensors (the experts as views of ours)."""
    out, biased = {}, []
    for name, t in sd.items():
        m = _OURS_MOE.fullmatch(name)
        if m is None:
            out[hf_names.to_hf_name(name, _BLOCK)] = t
        elif m.group(2) == "expert_bias":
            if t.any():
                biased.append(m.group(1))
        else:
            out.update(split_experts(m.group(1), _EXPERT[m.group(2)[-2:]], t))
    if biased:
        warnings.warn(
            f"layers {', '.join(biased)} have a non-zero expert_bias, which Hugging Face's "
            "Qwen3-MoE lacks: the exported model chooses its experts without it",
            stacklevel=2,
        )
    return out


def split_experts(layer: str, proj: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """[E, out, in] -> one `model.layers.{layer}.mlp.experts.{j}.{proj}.weight` per expert."""
    return {f"model.layers.{layer}.mlp.experts.{j}.{proj}.weight": w[j] for j in range(len(w))}


# ------------------------------------------------------------------------------- import
def from_hf(hf: dict[str, torch.Tensor], args: Qwen3MoEArgs) -> dict[str, torch.Tensor]:
    """Hugging Face tensors, per-expert (on disk) or fused (transformers' in-memory names),
    -> our state dict, with a zero `expert_bias` per layer."""
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out, rest = {}, {}
    for name, t in hf.items():
        if m := _PER_EXPERT.fullmatch(name):
            layer, j, proj = m.groups()
            per_expert.setdefault((layer, proj), {})[int(j)] = t
        elif m := _FUSED.fullmatch(name):
            out.update(unfuse_experts(m.group(1), m.group(2), t, args.moe_ffn_dim))
        else:
            rest[name] = t
    for (layer, proj), experts in per_expert.items():
        out[f"layers.{layer}.moe.experts.{_EXPERT_BACK[proj]}"] = stack_experts(
            experts, args.n_experts, f"layer {layer} {proj}"
        )
    out.update(hf_names.from_hf(rest, args, _BLOCK_BACK))
    for i in range(args.n_layers):
        out[f"layers.{i}.moe.expert_bias"] = torch.zeros(args.n_experts)
    return out


def stack_experts(experts: dict[int, torch.Tensor], n_experts: int, what: str) -> torch.Tensor:
    """{expert index: [out, in]} -> [E, out, in]; every expert 0..E-1 must be there."""
    if sorted(experts) != list(range(n_experts)):
        missing = sorted(set(range(n_experts)) - experts.keys())
        extra = sorted(experts.keys() - set(range(n_experts)))
        raise KeyError(f"{what}: experts {missing} missing, {extra} beyond n_experts")
    return torch.stack([experts[j] for j in range(n_experts)])


def unfuse_experts(layer: str, name: str, t: torch.Tensor, hidden: int) -> dict:
    """transformers' fused `gate_up_proj` [E, 2F, dim] (gate first) or `down_proj`."""
    prefix = f"layers.{layer}.moe.experts"
    if name == "down_proj":
        return {f"{prefix}.w2": t}
    gate, up = t.split(hidden, dim=1)
    return {f"{prefix}.w1": gate.contiguous(), f"{prefix}.w3": up.contiguous()}


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
