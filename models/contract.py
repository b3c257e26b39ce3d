"""The model contract: what a family gives the framework, as data (`ModelSpec`), and the
registry it joins. This module imports no family and no parallelism.

A family folder `models/<name>/` fulfils it (Llama 3, Qwen3 and Qwen3-MoE are the examples):
- `model_cls(args)` builds the model on any device (meta included) and knows no parallelism:
  blocks in `model.layers` (a ModuleDict keyed by layer index), the `embeddings` and `head`
  modules the spec names (None on pipeline stages that lack them), `init_param(name, tensor,
  generator)` (the full value of one parameter), `init_buffers(device)`, and `tie_weights()`
  when some parameters are shared (called again after materialisation, which unties them)
  with `tied_parameters()` naming them ({second use: the parameter's own name}: a pipeline
  split keeps the two uses on two stages as equal copies);
- `args` dataclass fields the framework reads (`ARGS_FIELDS`); the `[model]` shape overrides
  replace fields of that name; a mixture-of-experts family also `n_experts` and `top_k`;
- `tp_plan(loss_parallel)`: its tensor-parallel plan (a `models.tp_plan.TPPlan`);
  the generic decoder path (`parallelisms/decoder.py`) applies TP, activation checkpointing,
  compile and data parallelism, and cuts pipeline stages, from this data;
- `validate(cfg, args) -> list[str]` (optional): what the family cannot run beyond the generic
  checks, found with the config before any process group starts.
The family's package registers its spec when imported (`register(ModelSpec(...))`); families
outside this tree do the same in the module `job.custom_import` names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The args fields the framework reads (the FLOPs formula, the TP and pipeline checks, the
# loader, the estimator); a family's args dataclass may have any others.
ARGS_FIELDS = {
    "dim": int,
    "n_layers": int,
    "n_heads": int,
    "n_kv_heads": int,
    "head_dim": int,
    "vocab_size": int,
    "max_seq_len": int,
}


@dataclass(frozen=True)
class HFTensor:
    """Where one of our tensors is in a Hugging Face checkpoint, described so that any slice of
    ours maps to a bounded slice of Hugging Face's (what lets each rank read only its part):
    - `names`: one HF tensor of our shape; or, with `stacked`, one per index of our dim 0 (the
      experts: ours[j] is names[j]); or none: not stored by Hugging Face, zero on import and
      left out of an export (Qwen3-MoE's expert_bias);
    - `rows` (optional): (our row indices, an int64 tensor) -> the HF rows holding them, a
      permutation within blocks of rows (Llama's Q/K rows within each head);
    - `tied`: the HF tensor read instead when names[0] is absent (a tied output matrix)."""

    names: tuple[str, ...]
    stacked: bool = False
    rows: Callable[[Any], Any] | None = None
    tied: str | None = None


@dataclass(frozen=True)
class HFAdapter:
    """How a family's weights and config.json map to Hugging Face's (optional), used by
    scripts/convert_from_hf.py and convert_to_hf.py and by a run that loads or saves Hugging
    Face folders (checkpoint/hf.py)."""

    model_type: str  # the config.json "model_type" it reads
    args_from_config: Callable[[dict], Any]  # config.json -> args
    config_from_args: Callable[[Any, Any], dict]  # (args, dtype) -> config.json
    to_hf: Callable[[dict, Any], dict]  # (our full state dict, args) -> HF tensors
    from_hf: Callable[[dict, Any], dict]  # (HF tensors, args) -> our state dict
    # (our tensor name, args) -> where it is in HF files: what streams and shards use; the
    # whole-dict functions above must agree with it (tests/unit/test_hf_stream.py checks)
    tensor: Callable[[str, Any], HFTensor] | None = None
    # (args from config.json, the tensor names the folder holds) -> the args of the model the
    # files hold, where config.json counts what a folder may lack (optional)
    args_for_files: Callable[[Any, set[str]], Any] | None = None

    @classmethod
    def of(cls, model_type: str, hf_module) -> HFAdapter:
        """The adapter of a family's hf module whose functions have the shared decoder
        families' names: args_from_hf_config, config_with_dtype, to_hf, from_hf, hf_tensor."""
        m = hf_module
        return cls(model_type, m.args_from_hf_config, m.config_with_dtype, m.to_hf, m.from_hf,
                   tensor=m.hf_tensor, args_for_files=getattr(m, "args_for_files", None))  # fmt: skip


@dataclass(frozen=True)
class RoutingHooks:
    """For a mixture-of-experts family: where its experts are (expert parallelism shards them)
    and the training-time routing state the trainer drives; each hook takes this rank's
    model parts (a list of modules)."""

    # (model_parts) -> {block key: the block's grouped experts}, whose `expert_weights` have
    # the expert index as dim 0
    experts: Callable[[list], dict[str, Any]]
    expert_weights: tuple[str, ...]
    # (model_parts, fn): fn(stats) sums the routing statistics over the data-parallel ranks
    set_stats_reduce: Callable[[list, Callable], None]
    # (model_parts, on): off for a forward whose routing must not count (shape inference)
    set_counting: Callable[[list, bool], None]
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
class MatrixLayout:
    """How the Muon optimizer reads a stored weight [..., a, b] that is not one [out, in]
    matrix (or a stack of them along the leading dims, experts).

    `interleaved`: the last dim holds this many logical matrices with their columns
    interleaved (column j belongs to matrix j mod interleaved); each is orthogonalised alone.
    `rows_last`: stored [in, out] (used as x @ W): for the update scale rows and cols swap."""

    interleaved: int = 1
    rows_last: bool = False


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type
    flavors: dict[str, Any]
    tp_plan: Callable[[bool], Any]  # (loss_parallel) -> TPPlan
    validate: Callable[[Any, Any], list[str]] | None = None  # (job_config, args) -> problems
    # (args, seq_len, batch, tp) -> bytes one block saves for backward, for the estimator
    block_activation_bytes: Callable[[Any, int, int, int], float] | None = None
    hf: HFAdapter | None = None  # Hugging Face conversion
    routing: RoutingHooks | None = None  # mixture-of-experts families
    # Module names around the blocks: the embeddings run first (the first pipeline stage,
    # their own FSDP unit, left out of FLOPs and weight decay), the head last (the last stage).
    embeddings: tuple[str, ...] = ("tok_embeddings",)
    head: tuple[str, ...] = ("norm", "output")
    # Parameters whose name contains one of these get no weight decay (optimizer default).
    no_decay: tuple[str, ...] = ("norm", "tok_embeddings")
    # What torch.compile wraps in each block: "" the whole block, else a submodule's name
    # (routing with data-dependent shapes is left eager).
    compile_module: str = ""
    # args fields the checkpoint's RoPE and norm functions depend on (a resume compares them).
    function_args: tuple[str, ...] = ()
    # Muon: parameter-name suffix -> MatrixLayout, for weights not stored as [out, in] matrices
    matrix_layouts: dict[str, MatrixLayout] = dataclasses.field(default_factory=dict)


def is_muon_matrix(spec: ModelSpec, name: str, ndim: int) -> bool:
    """Whether the Muon optimizer holds parameter `name` (as the plain model names it) of
    `ndim` dims: matrices (stacks of them included) outside the family's embeddings and head."""
    return ndim >= 2 and name.split(".")[0] not in (*spec.embeddings, *spec.head)


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
                f"with {', '.join(bad) or 'the framework fields'} (models.contract.ARGS_FIELDS)"
            )
    MODELS[spec.name] = spec
    return spec
