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


def flops_per_token(
    num_params_no_embedding: int,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    seq_len: int,
) -> float:
    """Training FLOPs per token: ``6 * N + 12 * L * H * Dh * S``.

    ``6 * N`` covers the forward (2 FLOPs per multiply-add) and backward (2x forward)
    matmuls over the N non-embedding parameters (the embedding lookup is a gather, not
    a matmul). ``12 * L * H * Dh * S`` is the attention score and value matmuls
    (``Q @ K^T`` and ``P @ V``: 2 matmuls x 2 FLOPs x 3 for forward + backward) for
    sequence length S. Following the PaLM paper and torchtitan, causal attention is
    counted at FULL cost, i.e. the masked upper triangle is not subtracted, so this is
    an upper bound on the useful attention work (a causal kernel does about half).
    Activation recomputation is not counted, so MFU here is "model" FLOPs utilisation.
    """
    return float(6 * num_params_no_embedding + 12 * n_layers * n_heads * head_dim * seq_len)
