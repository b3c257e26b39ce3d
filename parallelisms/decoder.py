"""The one composition of parallelisms for every decoder family: a family gives data (its
`ModelSpec`: TP plan, embedding and head module names, what to compile, where its experts are)
and this module applies, in order,

  expert parallel -> tensor parallel -> activation checkpointing -> compile -> data parallel

to the whole model or to one pipeline stage of it. `assemble_model` is the one assembly every
entry point uses (trainer, planner, memory breakdown): context-parallel attention first, then
the pipeline cut, then the above. It also runs the generic checks every decoder needs before
any process group starts (`decoder_problems`).

Why this order: TP turns weights into tp-sharded DTensors that FSDP then shards on the data
dims, and its collectives belong inside the blocks that AC recomputes and compile traces; AC
comes before compile so each compiled block graph holds its checkpointing policy; data
parallelism comes last so FSDP/ZeRO hooks run around the compiled blocks, not in them. EP
first: the experts become "ep"-sharded DTensors that TP leaves alone and FSDP shards further.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from models.contract import ModelSpec
from models.init_weights import materialize
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.compile import apply_compile
from parallelisms.context_parallel import (
    apply_context_parallel,
    attention_problems,
    mixes_positions_outside_the_core,
    ulysses_problems,
)
from parallelisms.data_parallel import apply_data_parallel, apply_expert_zero
from parallelisms.expert_parallel import apply_ep, replicate_experts
from parallelisms.fsdp import FsdpUnit, embed_blocks_head_units, fsdp_mesh
from parallelisms.parallel_dims import ParallelDims, ParallelismError
from parallelisms.pipeline import (
    build_pipeline,
    is_v_schedule,
    schedule_class,
    stage_module_names,
    stage_to_rank,
)
from parallelisms.tensor_parallel import apply_tp, check_tp
from parallelisms.tied_weights import TiedWeights, tied_weights

if TYPE_CHECKING:
    from job_config.schema import ActivationCheckpoint, Compile, Parallelism, Training

logger = logging.getLogger("meshtrain")


@dataclass(frozen=True)
class AssemblyConfig:
    """The config sections a layout's assembly reads, and nothing else of the job config."""

    parallelism: Parallelism
    training: Training  # weight/compute/reduce dtypes, CPU offload, the local batch size
    activation_checkpoint: ActivationCheckpoint
    compile: Compile

    @classmethod
    def of(cls, job_config) -> AssemblyConfig:
        return cls(
            job_config.parallelism,
            job_config.training,
            job_config.activation_checkpoint,
            job_config.compile,
        )


def decoder_problems(spec: ModelSpec, cfg, args) -> list[str]:
    """What this run of the family cannot do, from the config alone: TP must split the heads
    and the sequence, CP must be able to honour every attention layer, then the family's own
    checks."""
    problems = []
    try:
        check_tp(args.n_heads, args.n_kv_heads, cfg.training.seq_len,
                 cfg.parallelism.tensor_parallel_degree)  # fmt: skip
    except ParallelismError as e:
        problems.append(str(e))
    if cfg.parallelism.context_parallel_degree > 1:
        with torch.device("meta"):  # shapes only: the check runs one forward
            problems += attention_problems(spec.model_cls(args), cfg.training.seq_len)
        problems += _sequence_mixing_problems(spec, args)
    problems += ulysses_problems(cfg.parallelism, args)
    if getattr(args, "mtp_depth", 0) and cfg.parallelism.pipeline_parallel_degree > 1:
        problems.append(
            f"model.mtp_depth = {args.mtp_depth} with parallelism.pipeline_parallel_degree = "
            f"{cfg.parallelism.pipeline_parallel_degree}: the multi-token-prediction modules "
            "embed later tokens with the first stage's embeddings and predict them with the last "
            "stage's output head, which a pipeline split puts on different ranks (not "
            "implemented). Set model.mtp_depth = 0 or parallelism.pipeline_parallel_degree = 1."
        )
    return problems + (spec.validate(cfg, args) if spec.validate else [])


def _sequence_mixing_problems(spec: ModelSpec, args) -> list[str]:
    """CP splits only what the attention cores compute: a family that mixes positions
    anywhere else is refused. Checked on a real instance of the family's `debugmodel` flavor
    (the same code at a small size; the configured shape itself when the family has none),
    initialised as a run initialises it (per-parameter generators: the global RNG is left as
    it was)."""
    small = spec.flavors.get("debugmodel", args)
    with torch.device("meta"):
        model = spec.model_cls(small)
    if small is args and sum(p.numel() for p in model.parameters()) > 10**8:
        logger.warning(
            "context parallelism: the %s family has no 'debugmodel' flavor, and the configured "
            "one is too large to build on the CPU: mixing of positions outside the attention "
            "cores is not checked (add a small 'debugmodel' flavor)",
            spec.name,
        )
        return []
    materialize(model, 0, torch.device("cpu"))
    if not mixes_positions_outside_the_core(model, spec.embeddings[0], 32):
        return []
    return [
        f"parallelism.context_parallel_degree > 1: the {spec.name} model mixes information "
        "across sequence positions outside its attention cores (with every core made "
        "per-position, one position's output still depends on other positions' inputs), which "
        "under CP would see only the rank's tokens. Compute everything that reads other "
        "positions inside models.attention.AttentionCore, or set "
        "parallelism.context_parallel_degree = 1."
    ]


def decoder_fsdp_units(model: nn.Module, spec: ModelSpec, parallel_dims: ParallelDims):
    """The embeddings (first in forward), each block, then the head (last in forward, first in
    backward); tied, the embeddings join the head's unit. Under EP each block's experts come
    first, sharded over the ranks outside EP, their reduced gradients divided by the whole
    DP x CP degree (they sum the EP group's tokens; dense gradients are averaged over DP x CP)."""
    tied = getattr(model.args, "tie_embeddings", False)
    units = embed_blocks_head_units(model, list(spec.embeddings), list(spec.head), tied)
    if spec.routing is None or not parallel_dims.ep_enabled:
        return units
    mesh = fsdp_mesh(parallel_dims, "dp_shard_mod_ep")
    divide = parallel_dims.dp * parallel_dims.cp
    experts = spec.routing.experts([model]).values()
    return [FsdpUnit([e], "experts", mesh=mesh, gradient_divide_factor=divide) for e in experts]


def _sum_over(group):
    def reduce(stats: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        return stats

    return reduce


def _apply_expert_parallel(model: nn.Module, spec: ModelSpec, parallel_dims: ParallelDims):
    """Routing statistics summed over the global micro-batch (all its sequences and CP shards);
    experts split over "ep", or replicated over "tp" when TP runs without EP."""
    routing = spec.routing
    if parallel_dims.data_parallel_enabled:
        routing.set_stats_reduce([model], _sum_over(parallel_dims.dim("dp_cp").get_group()))
    for experts in routing.experts([model]).values():
        if parallel_dims.ep_enabled:
            apply_ep(experts, parallel_dims.dim("ep"), routing.expert_weights)
        elif parallel_dims.tp_enabled:
            replicate_experts(experts, parallel_dims.dim("tp"), routing.expert_weights)


def parallelize_decoder(
    model: nn.Module,
    spec: ModelSpec,
    parallel_dims: ParallelDims,
    options: AssemblyConfig,
    device_type: str,
) -> nn.Module:
    """Applies the run's parallelisms to `model` (whole, or one pipeline stage) in place."""
    p, ac, comp = options.parallelism, options.activation_checkpoint, options.compile
    if spec.routing is not None:
        _apply_expert_parallel(model, spec, parallel_dims)
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.dim("tp"), spec.tp_plan(not p.disable_loss_parallel))
        model.tie_weights()  # TP distributed the two tied modules' weights one by one
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)
    if comp.enable and "model" in comp.components:
        apply_compile(model, spec.compile_module or None)
    if spec.routing is not None and parallel_dims.ep_enabled and parallel_dims.zero_stage < 3:
        for experts in spec.routing.experts([model]).values():  # own meshes, before the rest
            apply_expert_zero(experts, parallel_dims, options.training, device_type)
    if parallel_dims.data_parallel_enabled:
        units = functools.partial(decoder_fsdp_units, spec=spec, parallel_dims=parallel_dims)
        apply_data_parallel(model, parallel_dims, options.training, p, device_type, units)
    return model


@dataclass
class ModelParts:
    """What one rank holds of a layout's model: its parts (the whole model, or its pipeline
    stages) and, with PP, the schedule and whether the first/last stage is among them."""

    parts: list[nn.Module]
    schedule: object | None = None
    has_first_stage: bool = True
    has_last_stage: bool = True
    tied: TiedWeights | None = None  # tied weights the pipeline split keeps as two copies


def assemble_model(
    model: nn.Module,
    spec: ModelSpec,
    parallel_dims: ParallelDims,
    options: AssemblyConfig,
    device: torch.device,
    loss_fn,
) -> ModelParts:
    """The whole (meta-device) model -> context-parallel attention -> pipeline split (the
    planned layers, the embeddings on the first stage, the head on the last) ->
    `parallelize_decoder` on the whole model or each stage, in place: this rank's parts, not
    yet materialised. CP comes first so the stages, the blocks AC recomputes and the graphs
    compile traces hold its gathers."""
    if parallel_dims.cp_enabled:
        method = options.parallelism.context_parallel_method
        apply_context_parallel(model, parallel_dims.dim("cp"), method)
    parallelize = functools.partial(
        parallelize_decoder,
        spec=spec,
        parallel_dims=parallel_dims,
        options=options,
        device_type=device.type,
    )
    if not parallel_dims.pp_enabled:
        return ModelParts([parallelize(model)])
    p, batch = options.parallelism, options.training.local_batch_size
    names = stage_module_names(len(model.layers), p, spec.embeddings, spec.head)
    built = ModelParts(
        *build_pipeline(model, parallel_dims, p, batch, device, loss_fn, names, parallelize)
    )
    if spec.routing is not None:
        schedule = built.schedule
        for stage in getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]:
            _uncounted_metadata_forward(stage, spec.routing)
    pp_mesh = parallel_dims.dim("pp")
    v_style = is_v_schedule(schedule_class(p.pipeline_parallel_schedule))
    owner = stage_to_rank(pp_mesh.size(), len(names), v_style)
    built.tied = tied_weights(
        built.parts, pp_mesh.get_group(), pp_mesh.get_local_rank(), owner[0], owner[len(names) - 1]
    )
    return built


_METADATA_FORWARDS = ("_forward_metadata_inference", "_shape_inference")


def _uncounted_metadata_forward(stage, routing) -> None:
    """torch's pipeline stages run one extra forward on the first step to learn the shapes
    they exchange (on placeholder inputs); its routing must not count as the step's. Wraps
    that method (its name differs across torch versions) so the stage's routing skips it."""
    name = next((n for n in _METADATA_FORWARDS if hasattr(stage, n)), None)
    if name is None:
        logger.warning(
            "MoE + pipeline: this torch's stages have none of %s; if they run a shape-inference "
            "forward, its routing counts toward the first step's balancing statistics",
            ", ".join(_METADATA_FORWARDS),
        )
        return
    infer, parts = getattr(stage, name), [stage.submod]

    def uncounted(*args, **kwargs):
        routing.set_counting(parts, False)
        try:
            return infer(*args, **kwargs)
        finally:
            routing.set_counting(parts, True)

    setattr(stage, name, uncounted)
