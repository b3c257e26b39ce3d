"""Model registry: a model name maps to its family's `ModelSpec`, everything the framework
knows about an architecture.

The contract a family folder `models/<name>/` fulfils (Llama 3 and Qwen3 are the examples):
- `model_cls(args)` builds the model on any device (meta included) and knows no parallelism:
  blocks in `model.layers` (a ModuleDict keyed by layer index), optional `tok_embeddings`,
  `norm`, `output` (None on pipeline stages that lack them), `init_param(name, tensor,
  generator)` (the full value of one parameter), `init_buffers(device)`, and `tie_weights()`
  when some parameters are shared (called again after materialisation, which unties them);
- `args` dataclass fields the framework reads: `n_layers`, `n_heads`, `head_dim`, `dim`,
  `vocab_size`, `max_seq_len`; the `[model]` shape overrides replace fields of that name; a
  mixture-of-experts family (one with `routing` hooks) also `n_experts` and `top_k`, which
  the estimator reads (EP degrees, all-to-all volume; it finds the expert parameters
  themselves as the ones its parallelize function puts on the "ep" mesh);
- `parallelize_fn(model, parallel_dims, job_config, device_type)`: TP plan, AC, compile and
  FSDP units applied with the generic `parallelisms` functions (plans are data in the family);
- `pipeline_fn` (optional): how the model is cut into stages;
- `validate(cfg, args) -> list[str]` (optional): what this family cannot run, checked with the
  config before any process group starts.

Families outside this tree register themselves with `register(ModelSpec(...))` in a module
that `job.custom_import` names.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models import qwen3, qwen3_moe
from models.llama3 import Transformer, llama3_flavors
from models.llama3 import hf as llama3_hf
from models.qwen3 import hf as qwen3_hf
from models.qwen3_moe import hf as qwen3_moe_hf

# The args fields the framework reads (the FLOPs formula, the TP and pipeline checks, the
# loader, the estimator); a family's args dataclass may have any others.
ARGS_FIELDS = {
    "dim": int,
    "n_layers": int,
    "n_heads": int,
    "head_dim": int,
    "vocab_size": int,
    "max_seq_len": int,
}


@dataclass(frozen=True)
class HFAdapter:
    """How a family's weights and config.json map to Hugging Face's (optional), used by
    scripts/convert_from_hf.py and convert_to_hf.py."""

    model_type: str  # the config.json "model_type" it reads
    args_from_config: Callable[[dict], Any]  # config.json -> args
    config_from_args: Callable[[Any, Any], dict]  # (args, dtype) -> config.json
    to_hf: Callable[[dict, Any], dict]  # (our full state dict, args) -> HF tensors
    from_hf: Callable[[dict, Any], dict]  # (HF tensors, args) -> our state dict


@dataclass(frozen=True)
class RoutingHooks:
    """For a family whose layers keep training-time routing state (mixture of experts); the
    trainer calls them with this rank's model parts."""

    # (model_parts, scale): the factor the trainer divides token-loss sums by (1 / tokens per
    # rank and optimizer step), for losses the layers add themselves (load balancing)
    set_loss_scale: Callable[[list, float], None]
    after_optimizer_step: Callable[[list], None]  # on the device, no host sync
    # per layer key, the last step's statistics (a host sync: log steps only)
    layer_stats: Callable[[list], dict[str, dict[str, float]]]
    # (every stage's layer stats, warn after this many idle steps) -> (record, warnings)
    summarize: Callable[[dict, int], tuple[dict[str, float], list[str]]]
    # (meta model) -> parameters one token uses, without the embeddings: the FLOPs convention
    active_params: Callable[[Any], int]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type
    flavors: dict[str, Any]
    parallelize_fn: Callable  # (model, parallel_dims, job_config, device_type) -> model
    pipeline_fn: Callable | None  # (model, parallel_dims, job_config, device, loss_fn) -> stages
    validate: Callable[[Any, Any], list[str]] | None = None  # (job_config, args) -> problems
    # (args, seq_len, batch, tp) -> bytes one block saves for backward, for the estimator
    block_activation_bytes: Callable[[Any, int, int, int], float] | None = None
    hf: HFAdapter | None = None  # Hugging Face conversion
    routing: RoutingHooks | None = None  # mixture-of-experts families


def _llama3_parallelize(*args, **kwargs):
    from models.llama3.parallelize import parallelize_llama  # imports torch.distributed lazily

    return parallelize_llama(*args, **kwargs)


def _llama3_pipeline(*args, **kwargs):
    from models.llama3.pipeline import pipeline_llama

    return pipeline_llama(*args, **kwargs)


def _llama3_validate(cfg, args) -> list[str]:
    from models.llama3.parallelize import validate_llama

    return validate_llama(cfg, args)


def _llama3_block_bytes(*args) -> float:
    from models.llama3.parallelize import llama_block_activation_bytes

    return llama_block_activation_bytes(*args)


MODELS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Adds a family to the registry (a repeated name is an error: one family per name); its
    flavors must be dataclasses with the `ARGS_FIELDS` the framework reads."""
    if spec.name in MODELS and MODELS[spec.name] is not spec:
        raise ValueError(f"model family '{spec.name}' is registered twice")
    for flavor, args in spec.flavors.items():
        bad = [f"{k} ({t.__name__})" for k, t in ARGS_FIELDS.items()
               if not isinstance(getattr(args, k, None), t)]  # fmt: skip
        if not dataclasses.is_dataclass(args) or bad:
            raise ValueError(
                f"model family '{spec.name}', flavor '{flavor}': the args must be a dataclass "
                f"with {', '.join(bad) or 'the framework fields'} (models.ARGS_FIELDS)"
            )
    MODELS[spec.name] = spec
    return spec


register(
    ModelSpec(
        "llama3",
        Transformer,
        llama3_flavors,
        _llama3_parallelize,
        _llama3_pipeline,
        _llama3_validate,
        _llama3_block_bytes,
        HFAdapter(
            "llama",
            llama3_hf.args_from_hf_config,
            llama3_hf.hf_config_from_args,
            llama3_hf.meta_to_hf,
            llama3_hf.hf_to_meta,
        ),
    )
)


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
    if name not in MODELS:
        raise ValueError(
            f"model.name = '{name}' is not registered. Known models: {', '.join(MODELS)} "
            "(a family outside this tree registers itself in the module job.custom_import "
            "names)."
        )
    return MODELS[name]


SHAPE_OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads")
# mixture-of-experts options, -1 = the flavor's value (families without experts reject them)
MOE_OVERRIDES = ("moe_aux_loss_coeff", "moe_bias_update_rate", "moe_z_loss_coeff")


def arg_overrides(model_cfg) -> dict[str, int | float | bool]:
    """The `[model]` overrides that are set (shapes non-zero, MoE options not -1, rope_scaling
    not 'flavor'), for `build_model_args`."""
    out = {k: getattr(model_cfg, k) for k in SHAPE_OVERRIDES if getattr(model_cfg, k, 0)}
    out |= {k: getattr(model_cfg, k) for k in MOE_OVERRIDES if getattr(model_cfg, k, -1) >= 0}
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
    base = spec.flavors[flavor]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides or {}) - fields)
    if unknown:
        raise ValueError(
            f"model.name = '{name}' has no {', '.join(unknown)} (set by the [model] section's "
            "overrides): drop them for this family."
        )
    args = dataclasses.replace(base, max_seq_len=seq_len, **(overrides or {}))
    if vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    return args


def model_args_for(model_cfg, seq_len: int, vocab_size: int | None = None):
    """`build_model_args` for a config's `[model]` section (name, flavor, shape overrides)."""
    return build_model_args(
        model_cfg.name, model_cfg.flavor, seq_len, vocab_size, arg_overrides(model_cfg)
    )


def meta_model_for(model_cfg, seq_len: int, vocab_size: int | None, error: type[Exception]):
    """(spec, model args, the whole model on the meta device: shapes only) of a config's
    `[model]` section; a flavor or shape that `model_args_for` refuses raises `error`."""
    import torch

    spec = get_model_spec(model_cfg.name)
    try:
        args = model_args_for(model_cfg, seq_len, vocab_size)
    except ValueError as e:
        raise error(str(e)) from None
    with torch.device("meta"):
        return spec, args, spec.model_cls(args)


register(
    ModelSpec(
        "qwen3",
        qwen3.Qwen3,
        qwen3.flavors,
        qwen3.parallelize,
        qwen3.pipeline,
        qwen3.validate,
        qwen3.block_activation_bytes,
        HFAdapter(
            "qwen3",
            qwen3_hf.args_from_hf_config,
            qwen3_hf.config_with_dtype,
            qwen3_hf.to_hf,
            qwen3_hf.from_hf,
        ),  # fmt: skip
    )
)


def _qwen3_moe_routing() -> RoutingHooks:
    from models.qwen3_moe import routing

    return RoutingHooks(
        routing.set_loss_scale,
        routing.after_optimizer_step,
        routing.layer_stats,
        routing.summarize,
        routing.active_params,
    )


register(
    ModelSpec(
        "qwen3_moe",
        qwen3_moe.Qwen3MoE,
        qwen3_moe.flavors,
        qwen3_moe.parallelize,
        qwen3_moe.pipeline,
        qwen3_moe.validate,
        qwen3_moe.block_activation_bytes,
        HFAdapter(
            "qwen3_moe",
            qwen3_moe_hf.args_from_hf_config,
            qwen3_moe_hf.config_with_dtype,
            qwen3_moe_hf.to_hf,
            qwen3_moe_hf.from_hf,
        ),  # fmt: skip
        routing=_qwen3_moe_routing(),
    )
)
