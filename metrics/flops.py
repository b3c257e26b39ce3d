"""Parameter counting and the training FLOPs-per-token model used for MFU."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _under(param_name: str, modules: Sequence[str]) -> bool:
    """True if a parameter's qualified name lives under one of the named modules."""
    return any(m in param_name.split(".")[:-1] for m in modules)


def count_params(model: torch.nn.Module, embeddings: Sequence[str] = ()) -> int:
    """Count the model's parameters (global element count).

    Works on meta-device models and on DTensor-sharded parameters (FSDP2/TP), whose
    ``numel()`` is already the global size. A parameter reachable under several names
    (tied weights) is counted once. The parameters of the ``embeddings`` modules (the
    family's ``ModelSpec.embeddings``) are dropped, unless they are also used by another
    module (an output projection tied to the embedding still does matmul work, so it is kept).
    """
    names_by_param: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(name)
        params[id(param)] = param

    total = 0
    for key, param in params.items():
        if embeddings and all(_under(n, embeddings) for n in names_by_param[key]):
            continue
        total += param.numel()
    return total


def attention_span(spec, seq_len: int) -> float:
    """Keys a query sees on average over the positions 0..S-1 of an S-token sequence, for an
    attention layer's spec (`causal`, `window`: models.attention.AttentionSpec): all S
    without a causal mask, (S + 1) / 2 causally, the mean of min(window, position + 1) with a
    causal sliding window (a window without causality adds the later keys). Document masking
    depends on the data and is not taken off."""
    s = seq_len
    if spec.window is None:
        return (s + 1) / 2 if spec.causal else float(s)
    w = min(spec.window, s)
    earlier = (w * (w + 1) / 2 + (s - w) * w) / s  # mean of min(w, i + 1), itself included
    return earlier if spec.causal else earlier + (s - 1) / 2


def flops_per_token(
    num_params_no_embedding: int,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    seq_len: int,
    attention: Sequence | None = None,
) -> float:
    """Training FLOPs per token: ``6 * N + 12 * H * Dh * sum_l span_l``.

    ``6 * N`` covers the forward (2 FLOPs per multiply-add) and backward (2x forward)
    matmuls over the N non-embedding parameters (the embedding lookup is a gather, not
    a matmul). ``12 * H * Dh * span_l`` is layer l's attention score and value matmuls
    (``Q @ K^T`` and ``P @ V``: 2 matmuls x 2 FLOPs x 3 for forward + backward) over the keys
    a query sees on average (`attention_span`): about S / 2 for causal attention, the window
    for a sliding window much shorter than S. `attention`: the `AttentionSpec` of each layer
    whose attention runs in a shared core (`planning.memory.layer_attention_specs` of the
    model); the other layers of the `n_layers` (all of them for None; a family that computes
    attention itself) count as plain causal, so no family's attention counts as free.
    Activation recomputation is not counted, so MFU here is "model" FLOPs utilisation.
    """
    specs = list(attention or ())
    uncovered = max(n_layers - len(specs), 0)
    span = sum(attention_span(spec, seq_len) for spec in specs) + uncovered * (seq_len + 1) / 2
    return float(6 * num_params_no_embedding + 12 * n_heads * head_dim * span)
