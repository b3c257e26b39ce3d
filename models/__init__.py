"""The model registry: a model name maps to its family's `ModelSpec` (`models/contract.py`
says what a family gives the framework). Each family package under `models/` registers itself
when imported; `get_model_spec` imports a built-in family the first time its name is asked
for, so importing `models` (or a parallelism that uses the contract) registers none of them.
Families outside this tree register themselves in the module `job.custom_import` names.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

from models.contract import ARGS_FIELDS, MODELS, HFAdapter, ModelSpec, RoutingHooks, register

__all__ = [
    "ARGS_FIELDS",
    "HFAdapter",
    "ModelSpec",
    "RoutingHooks",
    "all_model_specs",
    "build_model_args",
    "get_model_spec",
    "import_families",
    "model_args_for",
    "register",
]


def builtin_families() -> list[str]:
    """The family packages in this folder (every subpackage of `models`)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)


def all_model_specs() -> dict[str, ModelSpec]:
    """Every registered family, the built-in ones imported first."""
    for name in builtin_families():
        importlib.import_module(f"models.{name}")
    return MODELS


def import_families(target: str) -> None:
    """Imports `job.custom_import`: a dotted module name, or the path of a .py file or of a
    package folder; a family it registers is then available by name."""
    if not target:
        return
    path = Path(target)
    try:
        if path.exists():
            init = path / "__init__.py" if path.is_dir() else path
            name = path.stem if path.is_file() else path.name
            spec = importlib.util.spec_from_file_location(name, init)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            importlib.import_module(target)
    except Exception as e:
        raise ValueError(f"job.custom_import = '{target}' failed: {type(e).__name__}: {e}") from e


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODELS and name in builtin_families():
        importlib.import_module(f"models.{name}")  # the package registers itself
    if name not in MODELS:
        known = ", ".join(all_model_specs())
        raise ValueError(
            f"model.name = '{name}' is not registered. Known models: {known} "
            "(a family outside this tree registers itself in the module job.custom_import "
            "names)."
        )
    return MODELS[name]


# The args fields a config sets (when not at its default), by the option that sets them:
# shapes (0 = the flavor's), mixture-of-experts and multi-token-prediction options (-1 = the
# flavor's) and RoPE scaling
# ('flavor' = the flavor's). A family whose args lack a field refuses its option when set.
SHAPE_OVERRIDES = {k: f"model.{k}" for k in ("dim", "n_layers", "n_heads", "n_kv_heads")}
MOE_OVERRIDES = {
    f"moe_{k}": f"moe.{k}" for k in ("aux_loss_coeff", "bias_update_rate", "z_loss_coeff")
}
MTP_OVERRIDES = {k: f"model.{k}" for k in ("mtp_depth", "mtp_loss_weight")}
OVERRIDE_OPTIONS = {**SHAPE_OVERRIDES, **MOE_OVERRIDES, **MTP_OVERRIDES,
                    "use_scaled_rope": "model.rope_scaling"}  # fmt: skip


def arg_overrides(cfg) -> dict[str, int | float | bool]:
    """The args fields a JobConfig sets (`[model]` shapes non-zero, `[moe]` options and
    model.mtp_* not -1, model.rope_scaling not 'flavor'), for `build_model_args`."""
    model, moe = cfg.model, cfg.moe
    out = {k: getattr(model, k) for k in SHAPE_OVERRIDES if getattr(model, k)}
    for field, option in MOE_OVERRIDES.items():
        value = getattr(moe, option.partition(".")[2])
        if value >= 0:
            out[field] = value
    out |= {k: getattr(model, k) for k in MTP_OVERRIDES if getattr(model, k) >= 0}
    if model.rope_scaling != "flavor":
        out["use_scaled_rope"] = model.rope_scaling == "llama3"
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
    base = spec.flavors[flavor]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides or {}) - fields)
    if unknown:
        options = [OVERRIDE_OPTIONS.get(k, k) for k in unknown]
        raise ValueError(
            f"model.name = '{name}' has no {', '.join(unknown)} (the args field set by "
            f"{', '.join(options)}), so {'it' if len(options) == 1 else 'they'} would be "
            f"ignored: leave {', '.join(options)} at the default (0 for shapes, -1 for [moe] and "
            "model.mtp_*, 'flavor' for model.rope_scaling) for this family, or drop it."
        )
    args = dataclasses.replace(base, max_seq_len=seq_len, **(overrides or {}))
    if vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    return args


def model_args_for(cfg, seq_len: int, vocab_size: int | None = None):
    """`build_model_args` for a JobConfig (`[model]` name, flavor, overrides; `[moe]`)."""
    return build_model_args(
        cfg.model.name, cfg.model.flavor, seq_len, vocab_size, arg_overrides(cfg)
    )


def meta_model_for(cfg, seq_len: int, vocab_size: int | None, error: type[Exception]):
    """(spec, model args, the whole model on the meta device: shapes only) of a JobConfig's
    model; a flavor or override that `model_args_for` refuses raises `error`."""
    import torch

    spec = get_model_spec(cfg.model.name)
    try:
        args = model_args_for(cfg, seq_len, vocab_size)
    except ValueError as e:
        raise error(str(e)) from None
    with torch.device("meta"):
        return spec, args, spec.model_cls(args)
