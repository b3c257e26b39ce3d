"""Model registry: a model name maps to its class, flavors, parallelize and pipeline functions.

To add an architecture, copy `models/llama3/` to `models/<name>/`, edit it, and add one
`ModelSpec` entry below; the trainer needs no change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.llama3 import Transformer, llama3_flavors


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type
    flavors: dict[str, Any]
    parallelize_fn: Callable  # (model, parallel_dims, job_config) -> model
    pipeline_fn: Callable | None  # (model, parallel_dims, job_config, device, loss_fn) -> stages


def _llama3_parallelize(*args, **kwargs):
    from models.llama3.parallelize import parallelize_llama  # imports torch.distributed lazily

    return parallelize_llama(*args, **kwargs)


def _llama3_pipeline(*args, **kwargs):
    from models.llama3.pipeline import pipeline_llama

    return pipeline_llama(*args, **kwargs)


MODELS: dict[str, ModelSpec] = {
    "llama3": ModelSpec(
        "llama3", Transformer, llama3_flavors, _llama3_parallelize, _llama3_pipeline
    ),
}


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(
            f"model.name = '{name}' is not registered. Known models: {', '.join(MODELS)}."
        )
    return MODELS[name]


SHAPE_OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads")


def arg_overrides(model_cfg) -> dict[str, int | bool]:
    """The `[model]` overrides that are set (shapes non-zero, rope_scaling not 'flavor'), for
    `build_model_args`."""
    out = {k: getattr(model_cfg, k) for k in SHAPE_OVERRIDES if getattr(model_cfg, k, 0)}
    if model_cfg.rope_scaling != "flavor":
        out["use_scaled_rope"] = model_cfg.rope_scaling == "llama3"
    return out


def build_model_args(
    name: str,
    flavor: str,
    seq_len: int,
    vocab_size: int | None = None,
    overrides: dict[str, int | bool] | None = None,
):
    """The flavor's arguments with the run's sequence length, shape `overrides` (from
    `arg_overrides`) and, when a tokenizer is loaded, its vocabulary size."""
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise ValueError(
            f"model.flavor = '{flavor}' is not a flavor of '{name}'. "
            f"Available: {', '.join(spec.flavors)}."
        )
    args = dataclasses.replace(spec.flavors[flavor], max_seq_len=seq_len, **(overrides or {}))
    if vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    return args


def model_args_for(model_cfg, seq_len: int, vocab_size: int | None = None):
    """`build_model_args` for a config's `[model]` section (name, flavor, shape overrides)."""
    return build_model_args(
        model_cfg.name, model_cfg.flavor, seq_len, vocab_size, arg_overrides(model_cfg)
    )
