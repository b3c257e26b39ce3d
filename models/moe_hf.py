"""The Hugging Face form of the shared MoE layer's experts (models/moe.py), for the families
whose published checkpoints store one linear per expert and projection (Qwen3-MoE,
DeepSeek-V3): `model.layers.{i}.mlp.experts.{j}.gate_proj.weight` is our `w1[j]`, `up_proj`
`w3[j]`, `down_proj` `w2[j]`. transformers 5 stacks those on load into the fused
`experts.gate_up_proj` [E, 2F, dim] (gate rows first) and `experts.down_proj` [E, dim, F] of
its in-memory model; both forms are read here, the per-expert one is written."""

from __future__ import annotations

import re

import torch

from models.contract import HFTensor

EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}  # ours -> HF projection
_EXPERT_BACK = {v: k for k, v in EXPERT.items()}
OURS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w[123])")
_PER_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
)
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def expert_tensor(layer: str, weight: str, n_experts: int) -> HFTensor:
    """Where our `layers.{layer}.moe.experts.{weight}` [E, out, in] is: one tensor per expert."""
    names = [f"model.layers.{layer}.mlp.experts.{j}.{EXPERT[weight]}.weight"
             for j in range(n_experts)]  # fmt: skip
    return HFTensor(tuple(names), stacked=True)


def split_experts(layer: str, weight: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our [E, out, in] `weight` of block `layer` -> one HF tensor per expert (views)."""
    proj = EXPERT[weight]
    return {f"model.layers.{layer}.mlp.experts.{j}.{proj}.weight": w[j] for j in range(len(w))}


def experts_from_hf(
    hf: dict[str, torch.Tensor], n_experts: int, hidden: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(our expert weights, the HF tensors that are not experts) of HF tensors in either form;
    `hidden`: the experts' FFN width (where the fused gate_up_proj is cut)."""
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    ours, rest = {}, {}
    for name, t in hf.items():
        if m := _PER_EXPERT.fullmatch(name):
            layer, j, proj = m.groups()
            per_expert.setdefault((layer, proj), {})[int(j)] = t
        elif m := _FUSED.fullmatch(name):
            ours.update(_unfused(m.group(1), m.group(2), t, hidden))
        else:
            rest[name] = t
    for (layer, proj), experts in per_expert.items():
        ours[f"layers.{layer}.moe.experts.{_EXPERT_BACK[proj]}"] = stack_experts(
            experts, n_experts, f"layer {layer} {proj}"
        )
    return ours, rest


def stack_experts(experts: dict[int, torch.Tensor], n_experts: int, what: str) -> torch.Tensor:
    """{expert index: [out, in]} -> [E, out, in]; every expert 0..E-1 must be there."""
    if sorted(experts) != list(range(n_experts)):
        missing = sorted(set(range(n_experts)) - experts.keys())
        extra = sorted(experts.keys() - set(range(n_experts)))
        raise KeyError(f"{what}: experts {missing} missing, {extra} beyond n_experts")
    return torch.stack([experts[j] for j in range(n_experts)])


def _unfused(layer: str, name: str, t: torch.Tensor, hidden: int) -> dict:
    """transformers' fused `gate_up_proj` [E, 2F, dim] (gate first) or `down_proj`."""
    prefix = f"layers.{layer}.moe.experts"
    if name == "down_proj":
        return {f"{prefix}.w2": t}
    gate, up = t.split(hidden, dim=1)
    return {f"{prefix}.w1": gate.contiguous(), f"{prefix}.w3": up.contiguous()}
