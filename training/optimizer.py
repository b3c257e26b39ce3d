"""AdamW (or Muon with AdamW, `training.muon`) with weight-decay groups, and the warmup + decay
learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from models import get_model_spec
from models.contract import is_muon_matrix
from models.init_weights import canonical_name


def no_decay_patterns(cfg) -> list[str]:
    """A JobConfig's no-decay patterns: optimizer.no_decay_patterns, or when it is None the
    model family's (`ModelSpec.no_decay`)."""
    given = cfg.optimizer.no_decay_patterns
    return list(get_model_spec(cfg.model.name).no_decay if given is None else given)


def _trainable(model_parts: list[nn.Module]):
    """(name, parameter) of every trainable parameter; a tied weight's copy under the name of
    the weight it copies."""
    for part in model_parts:
        tied = part.tied_parameters() if hasattr(part, "tied_parameters") else {}
        for raw, p in part.named_parameters():
            if p.requires_grad:
                yield tied.get(canonical_name(raw), raw), p


def _groups(named: list, weight_decay: float, no_decay: list[str], **extra) -> list[dict]:
    """Decayed parameters and those whose name contains a `no_decay` pattern, each group split
    by kind where it holds both DTensors and plain tensors (expert-parallel experts beside
    ZeRO-0's plain dense weights): fused and foreach kernels take one kind per call."""
    decay = [p for n, p in named if not any(s in n for s in no_decay)]
    keep = [p for n, p in named if any(s in n for s in no_decay)]
    groups = []
    for params, wd in ((decay, weight_decay), (keep, 0.0)):
        kinds = [[p for p in params if isinstance(p, DTensor) is d] for d in (False, True)]
        groups += [{"params": k, "weight_decay": wd, **extra}
                   for k in (kinds if all(kinds) else [params])]  # fmt: skip
    return groups


def param_groups(model_parts: list[nn.Module], weight_decay: float, no_decay: list[str]):
    """Two groups (AdamW): decayed weights, and parameters whose name contains a `no_decay`
    pattern (each split by kind, `_groups`)."""
    return _groups(list(_trainable(model_parts)), weight_decay, no_decay)


def build_muon(model_parts, cfg, adamw_kwargs: dict, no_decay: list[str], spec):
    """Muon on the hidden matrices, AdamW (`adamw_kwargs`: lr, betas, eps, kernel) on the rest
    (`training.muon`)."""
    from training.muon import MuonOptions, MuonWithAdamW

    named = list(_trainable(model_parts))
    muon = [(n, p) for n, p in named if is_muon_matrix(spec, n, p.ndim)]
    adamw = [(n, p) for n, p in named if not is_muon_matrix(spec, n, p.ndim)]
    layouts = {id(p): layout for n, p in muon for suffix, layout in spec.matrix_layouts.items()
               if canonical_name(n).endswith(suffix)}  # fmt: skip
    options = MuonOptions(
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps,
        ns_coefficients=tuple(cfg.muon_ns_coefficients),
        update_scale=cfg.muon_update_scale,
        ns_dtype=None if cfg.muon_ns_dtype == "param" else getattr(torch, cfg.muon_ns_dtype),
    )
    # AdamW's first: the LR logged is group 0's. No empty group: DCP's flattened state cannot
    # hold one, so which groups a rank has depends on its pipeline stage (checkpoint.state).
    groups = _groups(adamw, cfg.weight_decay, no_decay)
    groups += _groups(muon, cfg.weight_decay, no_decay, muon=True, lr=cfg.muon_lr or cfg.lr)
    groups = [g for g in groups if g["params"]]
    return MuonWithAdamW(groups, options, layouts=layouts, **adamw_kwargs)


def _fused_adam_devices() -> tuple[str, ...]:
    """Device types with a fused Adam(W) kernel in this torch build."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a private helper: fall back to the two every torch >= 2.4 has
        return ("cuda", "cpu")
    return tuple(_get_fused_kernels_supported_devices())


def build_optimizer(
    model_parts: list[nn.Module], cfg, device_type: str, no_decay: list[str], spec=None
) -> torch.optim.Optimizer:
    """One optimizer over all local model parts (several with virtual pipeline stages), from
    the `[optimizer]` section; `no_decay`: the resolved patterns (`no_decay_patterns`);
    `spec`: the family's ModelSpec (Muon reads its embeddings, head and matrix layouts)."""
    impl = cfg.implementation
    if impl == "auto":  # one kernel per step: on CPU too it beats foreach (benchmarks/)
        impl = "fused" if device_type in _fused_adam_devices() else "foreach"
    if cfg.name == "Muon" and spec is None:
        raise ValueError("optimizer.name = 'Muon' needs the model family's spec")
    kwargs = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "fused": impl == "fused",
        "foreach": impl == "foreach",
    }
    if cfg.name == "Muon":
        optimizer = build_muon(model_parts, cfg, kwargs, no_decay, spec)
    else:
        groups = param_groups(model_parts, cfg.weight_decay, no_decay)
        if cfg.name == "Adam":
            for g in groups:
                g["weight_decay"] = 0.0
        adam = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
        optimizer = adam(groups, **kwargs)
    if kwargs["fused"]:
        optimizer.register_step_pre_hook(contiguous_grads)
    return optimizer


def contiguous_grads(optimizer: torch.optim.Optimizer, *_) -> None:
    """Makes every gradient contiguous before a fused step (a step pre-hook).

    The fused Adam(W) kernel reads a gradient's memory in row-major order whatever its
    strides (torch 2.13 on CPU, measured: a transposed gradient updates the wrong elements).
    Autograd's own accumulation gives a gradient the parameter's layout, but the split
    backward of torch.distributed.pipelining's zero-bubble schedules assigns `param.grad`
    itself: Qwen3-MoE's experts (used as `w.mT`) then got transposed gradients and trained
    wrong under TP x PP with InterleavedZeroBubble / DualPipeV (the float64 parity row
    test_fp64_parity.py[moe_tp2_pp2_zero_bubble] holds it)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if local is not None and not local.is_contiguous():
                p.grad = p.grad.contiguous()


def lr_factor(
    step: int,
    total_steps: int,
    warmup: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """LR multiplier for optimizer step `step` (1-based): warmup, flat, then decay.

    Warmup rises linearly to 1 over `warmup` steps (step 1 gets 1/(warmup+1), never 0). The
    last `decay_ratio * total_steps` steps (all post-warmup steps when None, and never more:
    decay starts after warmup) decay from 1 to `min_lr_factor` following `decay_type`;
    `constant` holds 1 throughout.
    """
    if step <= warmup:
        return step / (warmup + 1)
    decay_steps = total_steps - warmup
    if decay_ratio is not None:
        decay_steps = min(decay_steps, round(total_steps * decay_ratio))
    decay_start = total_steps - decay_steps
    if decay_type == "constant" or step <= decay_start or decay_steps <= 0:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int):
    """LambdaLR whose internal counter starts at 0; `lr_factor` sees the 1-based step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(
            s + 1, total_steps, cfg.warmup_steps, cfg.decay_ratio, cfg.decay_type, cfg.min_lr_factor
        ),
    )
