"""The MoE layers' training-time state, for `models.contract.RoutingHooks` (every family built on
models/moe.py registers `ROUTING_HOOKS`): where the experts
are, how the routing statistics are summed over data-parallel ranks, the loss scale
of the auxiliary losses, the aux-loss-free bias update after each optimizer step, and the
router statistics of the step that the metrics log.

Everything here runs on the device without a host sync, except `layer_stats` (log steps only).
The expert counts the MoE layers accumulate are already global (summed over the data-parallel
ranks in forward), so every rank holding a layer moves its bias identically.
"""

from __future__ import annotations

import torch
from torch import nn

from models import mtp
from models.contract import RoutingHooks
from models.moe import MoE


def moe_layers(model_parts: list[nn.Module]) -> dict[str, MoE]:
    """This rank's MoE layers by block key ("3" for model.layers["3"], "mtp.0" for the first
    multi-token-prediction module's block, models/mtp.py); blocks without one (DeepSeek-V3's
    first, dense blocks) are left out."""
    out = {}
    for part in model_parts:
        for key, block in [*part.layers.items(), *mtp.blocks(part).items()]:
            moe = next((m for m in block.modules() if isinstance(m, MoE)), None)
            if moe is not None:
                out[key] = moe
    return out


def experts(model_parts: list[nn.Module]) -> dict[str, nn.Module]:
    """Each block's experts module (what expert parallelism shards), by block key."""
    return {key: moe.experts for key, moe in moe_layers(model_parts).items()}


def set_stats_reduce(model_parts: list[nn.Module], reduce) -> None:
    """`reduce(stats)` sums the routing statistics over the data-parallel ranks in forward, so
    load balancing sees the global micro-batch."""
    for moe in moe_layers(model_parts).values():
        moe.reduce_stats = reduce


def set_counting(model_parts: list[nn.Module], on: bool) -> None:
    """Off: the layers route without adding to the step's statistics (a shape-inference pass)."""
    for moe in moe_layers(model_parts).values():
        moe.counting = on


def set_loss_scale(model_parts: list[nn.Module], scale: float) -> None:
    for moe in moe_layers(model_parts).values():
        moe.loss_scale = scale


@torch.no_grad()
def after_optimizer_step(model_parts: list[nn.Module]) -> None:
    """Keeps the step's counts for the logs, moves each bias toward balance (DeepSeek-V3:
    b_i += rate x sign(mean load - load_i)), and starts the next step's counts."""
    for moe in moe_layers(model_parts).values():
        counts = moe.tokens_per_expert
        moe.last_counts = counts.clone()
        moe.last_aux = moe.aux_loss_sum.clone()
        idle = getattr(moe, "idle_steps", torch.zeros_like(counts))
        moe.idle_steps = torch.where(counts == 0, idle + 1, torch.zeros_like(idle))
        if moe.bias_rate > 0:
            moe.expert_bias += moe.bias_rate * torch.sign(counts.mean() - counts)
        counts.zero_()
        moe.aux_loss_sum.zero_()


def layer_stats(model_parts: list[nn.Module]) -> dict[str, dict[str, float]]:
    """Per layer, of the last optimizer step: the most and least loaded expert over the mean
    load, the load-balancing loss (summed over the step's micro-batches), the largest bias,
    and the longest run of steps any expert went without a token."""
    out = {}
    for key, moe in moe_layers(model_parts).items():
        counts = getattr(moe, "last_counts", None)
        if counts is None:
            continue
        mean = counts.mean().clamp_min(1e-9)
        values = torch.stack([
            counts.max() / mean, counts.min() / mean, moe.last_aux,
            moe.expert_bias.abs().max(), moe.idle_steps.max(),
        ]).tolist()  # fmt: skip
        out[key] = dict(zip(("max_load", "min_load", "aux_loss", "bias_drift", "idle"), values))
    return out


def summarize(per_layer: dict[str, dict[str, float]], idle_warn_steps: int):
    """(metrics record, warnings) from every stage's `layer_stats`."""
    if not per_layer:
        return {}, []
    layers = per_layer.values()
    record = {
        "max_load": max(s["max_load"] for s in layers),
        "min_load": min(s["min_load"] for s in layers),
        "aux_loss": sum(s["aux_loss"] for s in layers),
        "bias_drift": max(s["bias_drift"] for s in layers),
        "idle_steps": max(s["idle"] for s in layers),
    }
    idle = sorted(
        (k for k, s in per_layer.items() if s["idle"] >= idle_warn_steps),
        key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else k),
    )
    warnings = []
    if idle:
        warnings.append(
            f"MoE: an expert of layer(s) {', '.join(idle)} has received no token for "
            f"{idle_warn_steps} or more steps (a dead expert): raise the load-balancing "
            "(moe.aux_loss_coeff or moe.bias_update_rate) or lower the LR"
        )
    return record, warnings


def active_params(model: nn.Module) -> int:
    """Parameters one token uses, embeddings excluded (the MFU convention for MoE, as
    DeepSeek-V3 and torchtitan report it): everything but the experts, plus top_k / E of them."""
    args = model.args
    names: dict[int, list[str]] = {}
    params = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        params[id(p)] = p
    # an output projection tied to the embeddings still multiplies: kept
    used = [params[i] for i, ns in names.items() if any("tok_embeddings" not in n for n in ns)]
    total = sum(p.numel() for p in used)
    experts = sum(params[i].numel() for i, ns in names.items() if ".experts." in ns[0])
    return total - experts + experts * args.top_k // args.n_experts


def routing_hooks(expert_weights: tuple[str, ...]) -> RoutingHooks:
    """The hooks of a family whose blocks hold `models.moe.MoE` layers, their experts' weights
    named `expert_weights` (each [n_experts, ...]: expert parallelism splits dim 0)."""
    return RoutingHooks(
        experts=experts,
        expert_weights=expert_weights,
        set_stats_reduce=set_stats_reduce,
        set_counting=set_counting,
        set_loss_scale=set_loss_scale,
        after_optimizer_step=after_optimizer_step,
        layer_stats=layer_stats,
        summarize=summarize,
        active_params=active_params,
    )


def expert_split_problems(cfg, args) -> list[str]:
    """The config check of an MoE family: expert parallelism must split the experts evenly."""
    ep = cfg.parallelism.expert_parallel_degree
    if args.n_experts % ep:
        return [
            f"parallelism.expert_parallel_degree = {ep} must divide the {args.n_experts} "
            f"experts of model.flavor = '{cfg.model.flavor}'."
        ]
    return []
