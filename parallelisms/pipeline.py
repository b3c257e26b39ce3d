"""Pipeline parallelism, model-agnostic: plan stages by layer, cut a model into stage modules,
place stages on pipeline ranks, and build a `torch.distributed.pipelining` schedule by name.

A stage is a deep copy of the (meta-device) model with the modules of other stages removed:
layers are deleted from the layer ModuleDict, so parameter names stay those of the full model
(checkpoints and weight init see the same keys under every layout), and other top-level
modules (embeddings, final norm, output) are set to None; the model's forward skips them.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from job_config.problems import Problems
from parallelisms.parallel_dims import ParallelismError

if TYPE_CHECKING:
    from job_config.schema import Parallelism

# Schedules whose stages sit on ranks in a V (rank r holds stages r and 2*pp - 1 - r), so the
# first and last stage share rank 0; every other multi-stage schedule loops (stage s on s % pp).
_V_SCHEDULES = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
# Schedules that split backward into input- and weight-gradient passes (two backward passes
# over each stage's graph; compiled graphs then must not donate their saved buffers, see
# build_schedule), which under activation checkpointing torch supports with whole-block recomputation (full or every N-th block), not
# per-op selective AC: torch's selective checkpoint hands its saved op outputs to the first
# backward through a region and refuses a second ("Trying to backward an extra time").
_SPLIT_BACKWARD_SCHEDULES = _V_SCHEDULES | {"ScheduleInterleavedZeroBubble"}
# What the refusals above suggest instead: the schedules whose backward is one pass.
_ONE_PASS_BACKWARD = "1F1B, GPipe, Interleaved1F1B or LoopedBFS"
# The prefix of the pipeline options that plan stages, for error messages.
_KEY = "parallelism.pipeline_parallel"


def schedule_class(name: str) -> type:
    """The `torch.distributed.pipelining` schedule class for a name (case-insensitive)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    try:
        cls = get_schedule_class(name)
    except ValueError as e:
        raise ParallelismError(f"parallelism.pipeline_parallel_schedule: {e}") from None
    if cls.__name__ in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
        raise ParallelismError(
            f"parallelism.pipeline_parallel_schedule = '{name}' is an abstract base class; "
            "choose a concrete schedule such as 1F1B, GPipe, Interleaved1F1B or ZBVZeroBubble."
        )
    return cls


def is_single_stage(cls: type) -> bool:
    """True when the schedule runs exactly one stage per pipeline rank."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return issubclass(cls, PipelineScheduleSingle)


def is_v_schedule(cls: type) -> bool:
    return cls.__name__ in _V_SCHEDULES


def _layer_index(point: str, prefix: str) -> int | None:
    head, _, tail = point.rpartition(".")
    return int(tail) if head == prefix and tail.isdigit() else None


def plan_stage_layers(
    n_layers: int,
    pp: int,
    schedule_name: str,
    *,
    layers_per_stage: int = -1,
    split_points: Sequence[str] = (),
    layer_prefix: str = "layers",
) -> list[list[int]]:
    """Layer indices of every stage in pipeline order; raises ParallelismError on a bad plan.

    Explicit `split_points` (names of the first layer of each stage after the first) win over
    `layers_per_stage`; without either, layers are spread evenly over one stage per rank for
    single-stage schedules and two per rank for multi-stage ones.
    """
    cls = schedule_class(schedule_name)
    if split_points:
        stages, source = _stages_at_split_points(n_layers, split_points, layer_prefix)
    else:
        stages, source = _even_stages(n_layers, pp, cls, layers_per_stage)
    _check_stage_count(cls, pp, len(stages), source)
    return stages


def _stages_at_split_points(
    n_layers: int, split_points: Sequence[str], layer_prefix: str
) -> tuple[list[list[int]], str]:
    """The stages that start at each split point, and how the plan was asked for."""
    starts = []
    for point in split_points:
        idx = _layer_index(point, layer_prefix)
        if idx is None or not 0 < idx < n_layers:
            raise ParallelismError(
                f"{_KEY}_split_points: '{point}' is not a layer that can start a stage; use "
                f"'{layer_prefix}.N' with 0 < N < n_layers ({n_layers})."
            )
        starts.append(idx)
    if starts != sorted(set(starts)):
        raise ParallelismError(
            f"{_KEY}_split_points = {list(split_points)} must be strictly increasing "
            "(every stage needs at least one layer)."
        )
    bounds = [0, *starts, n_layers]
    stages = [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
    return stages, f"{_KEY}_split_points ({len(split_points)} points)"


def _even_stages(
    n_layers: int, pp: int, cls: type, layers_per_stage: int
) -> tuple[list[list[int]], str]:
    """Layers spread evenly over `layers_per_stage`'s stage count, or the schedule's default
    one (single-stage: one per rank, else two); and how the plan was asked for."""
    if layers_per_stage > 0:
        if n_layers % layers_per_stage:
            raise ParallelismError(
                f"{_KEY}_layers_per_stage = {layers_per_stage} does not divide the model's "
                f"{n_layers} layers; pick a divisor or use {_KEY}_split_points."
            )
        num_stages = n_layers // layers_per_stage
        source = f"{_KEY}_layers_per_stage = {layers_per_stage}"
    else:
        num_stages = pp if is_single_stage(cls) else 2 * pp
        source = f"the default for {cls.__name__}"
    if num_stages > n_layers:
        raise ParallelismError(
            f"{source} asks for {num_stages} stages but the model has only {n_layers} "
            f"layers; lower pipeline_parallel_degree ({pp}) or use a single-stage schedule."
        )
    return _even_split(n_layers, num_stages), source


def _check_stage_count(cls: type, pp: int, num_stages: int, source: str) -> None:
    """Raises unless `cls` can run `num_stages` stages on `pp` ranks."""
    single = is_single_stage(cls)
    if single and num_stages != pp:
        raise ParallelismError(
            f"{cls.__name__} runs one stage per rank, so it needs exactly {pp} stages "
            f"(pipeline_parallel_degree), but {source} gives {num_stages}."
        )
    if not single and (num_stages % pp or num_stages < 2 * pp):
        raise ParallelismError(
            f"{cls.__name__} runs several stages per rank: it needs a multiple of "
            f"pipeline_parallel_degree ({pp}) stages, at least {2 * pp}, but {source} gives "
            f"{num_stages}."
        )
    if is_v_schedule(cls) and num_stages != 2 * pp:
        raise ParallelismError(
            f"{cls.__name__} needs exactly two stages per rank ({2 * pp} stages), but {source} "
            f"gives {num_stages}."
        )


def _even_split(n_layers: int, num_stages: int) -> list[list[int]]:
    """Contiguous runs of near-equal length; the leftover layers go to middle stages first,
    since the first and last stages also carry the embedding and the output projection."""
    base, extra = divmod(n_layers, num_stages)
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1] if num_stages > 2 else [0, 1]
    sizes = [base] * num_stages
    for s in order[:extra]:
        sizes[s] += 1
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def stage_to_rank(pp: int, num_stages: int, v_style: bool) -> dict[int, int]:
    """The pipeline rank of every stage.

    Looped: stage s on rank s % pp. V: stages go down the ranks and back up, so with two stages
    per rank, rank r holds r and 2*pp - 1 - r (torch's ZBV/DualPipeV placement).
    """
    owner = {}
    for s in range(num_stages):
        lap, pos = divmod(s, pp)
        owner[s] = pp - 1 - pos if v_style and lap % 2 else pos
    return owner


def stage_ids_for_rank(pp_rank: int, pp: int, num_stages: int, v_style: bool) -> list[int]:
    """The stages this pipeline rank runs, in increasing order."""
    return [s for s, r in stage_to_rank(pp, num_stages, v_style).items() if r == pp_rank]


def microbatch_count(
    schedule_name: str, local_batch_size: int, microbatch_size: int, pp: int, num_stages: int
) -> int:
    """Pipeline microbatches per schedule step; raises ParallelismError where the schedule
    cannot run them."""
    cls = schedule_class(schedule_name)
    key = "parallelism.pipeline_parallel_microbatch_size"
    if local_batch_size % microbatch_size:
        raise ParallelismError(
            f"{key} = {microbatch_size} does not divide training.local_batch_size = "
            f"{local_batch_size}; the quotient is the number of pipeline microbatches."
        )
    n = local_batch_size // microbatch_size
    name = cls.__name__
    if name in ("Schedule1F1B", "ScheduleDualPipeV") and n < num_stages:
        raise ParallelismError(
            f"{name} needs at least as many microbatches as stages ({num_stages}), but "
            f"training.local_batch_size ({local_batch_size}) / {key} ({microbatch_size}) = {n}. "
            "Raise the local batch size or lower the microbatch size."
        )
    if name in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        rounds = max(1, n // pp)
        if n % rounds:
            raise ParallelismError(
                f"{name} needs the number of microbatches ({n} = local_batch_size "
                f"{local_batch_size} / {key} {microbatch_size}) to be a multiple of "
                f"max(1, microbatches // pipeline_parallel_degree) = {rounds}; use a multiple "
                f"of {pp} microbatches."
            )
    return n


def v_schedules_on_gloo(torch_version: str = torch.__version__) -> bool:
    """Whether this torch runs the V schedules on gloo. torch 2.11's open their stage links
    with point-to-point ops between neighbouring stages, two of which share a rank: a send to
    itself, which gloo cannot do (the first step fails with "Pair is not connected"). 2.13
    runs them; 2.12 is untested, so it counts as unable."""
    return tuple(int(x) for x in torch_version.split("+")[0].split(".")[:2]) >= (2, 13)


def validate_pipeline_config(
    parallelism,
    local_batch_size: int,
    n_layers: int,
    device_type: str = "cuda",
    torch_version: str = torch.__version__,
    per_op_ac: bool = False,
) -> None:
    """Every pipeline check that needs only the config: schedule name, stage plan, microbatch
    count, per-op selective AC (`per_op_ac`) and torch-version compatibility, all
    reported at once (an unknown schedule name alone, since the others depend on it). A no-op
    without pipeline parallelism."""
    pp = parallelism.pipeline_parallel_degree
    if pp <= 1:
        return
    name = parallelism.pipeline_parallel_schedule
    cls = schedule_class(name)
    problems = Problems(ParallelismError)
    stages = problems.run(
        plan_stage_layers,
        n_layers,
        pp,
        name,
        layers_per_stage=parallelism.pipeline_parallel_layers_per_stage,
        split_points=parallelism.pipeline_parallel_split_points,
    )
    problems.run(
        microbatch_count,
        name,
        local_batch_size,
        parallelism.pipeline_parallel_microbatch_size,
        pp,
        len(stages) if stages else 0,  # without a plan, the checks that need no stage count
    )
    if per_op_ac and cls.__name__ in _SPLIT_BACKWARD_SCHEDULES:
        problems.add(
            f"parallelism.pipeline_parallel_schedule = '{name}' with activation_checkpoint."
            "selective_ac_option = 'op': the schedule runs two backward passes (input, then "
            "weight gradients) over every checkpointed block, and torch's per-op selective AC "
            "allows one (the first consumes the op outputs it saved). Use activation_checkpoint"
            ".mode = 'full' or selective_ac_option = N (whole blocks, recomputed per pass), or "
            f"pick {_ONE_PASS_BACKWARD}."
        )
    if (
        cls.__name__ in _V_SCHEDULES
        and device_type == "cpu"
        and not v_schedules_on_gloo(torch_version)
    ):
        problems.add(
            f"{cls.__name__} on CPU (gloo) needs torch >= 2.13: torch {torch_version} sends "
            "between two stages on the same rank, which gloo cannot do. Upgrade torch, or "
            "pick Interleaved1F1B, LoopedBFS or InterleavedZeroBubble."
        )
    problems.raise_any()


def split_module(model: nn.Module, keep: Sequence[str]) -> nn.Module:
    """A deep copy of `model` holding only the top-level modules and ModuleDict entries named
    in `keep` ("tok_embeddings", "layers.3", ...); dropped ModuleDict entries are deleted (the
    kept keys stay as they were), other dropped children become None."""
    keep = set(keep)
    stage = copy.deepcopy(model)
    for name, child in list(stage.named_children()):
        if isinstance(child, nn.ModuleDict):
            for key in list(child.keys()):
                if f"{name}.{key}" not in keep:
                    del child[key]
        elif name not in keep:
            setattr(stage, name, None)
    return stage


def build_stages(
    model: nn.Module,
    module_names_per_stage: list[list[str]],
    stage_ids: list[int],
    pp_group,
    device: torch.device,
    parallelize: Callable[[nn.Module], nn.Module],
):
    """Stage modules and `PipelineStage`s for this rank's stage ids; each module goes through
    `parallelize` (TP/AC/compile/FSDP over the non-pipeline dimensions) first."""
    from torch.distributed.pipelining import PipelineStage

    num_stages = len(module_names_per_stage)
    parts, stages = [], []
    for sid in stage_ids:
        part = parallelize(split_module(model, module_names_per_stage[sid]))
        parts.append(part)
        stages.append(PipelineStage(part, sid, num_stages, device, group=pp_group))
    return parts, stages


def build_schedule(
    stages: list,
    schedule_name: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """The named schedule over this rank's stages. `loss_fn` must already be normalised (sum of
    token losses / tokens per optimizer step), so the schedule must not rescale gradients."""
    cls = schedule_class(schedule_name)
    if cls.__name__ in _SPLIT_BACKWARD_SCHEDULES:
        # The input-gradient pass keeps the graph for the weight-gradient pass
        # (retain_graph=True), which a compiled backward that donates its saved buffers refuses
        # ("compiled with non-empty donated buffers"): the compiled loss on the last stage.
        torch._functorch.config.donated_buffer = False
    if is_single_stage(cls):
        if len(stages) != 1:
            raise ParallelismError(f"{cls.__name__} takes one stage per rank, got {len(stages)}")
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if is_v_schedule(cls):
        # torch's eval() replays the training actions with backward disabled, and on V
        # schedules the local hand-off of input gradients between a rank's two stages then
        # asserts ("can't steal_bwd_input if this stage doesn't have backward"), so
        # evaluation runs a plain forward pass over the same stages instead.
        owner = stage_to_rank(stages[0].group_size, stages[0].num_stages, v_style=True)
        schedule.eval = functools.partial(forward_only, stages, owner, n_microbatches, loss_fn)
    return schedule


_WIRE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER_LEN = 8  # ndim, dtype index, up to 6 sizes


def _send(tensor: torch.Tensor, group, group_dst: int) -> None:
    """Blocking send of a tensor preceded by a fixed-size header (its dtype and shape)."""
    dst = dist.get_global_rank(group, group_dst)
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = tensor.dim(), _WIRE_DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.send(header, dst, group=group)
    dist.send(tensor.contiguous(), dst, group=group)


def _recv(group, group_src: int, device: torch.device) -> torch.Tensor:
    src = dist.get_global_rank(group, group_src)
    header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    ndim, dtype = int(header[0]), _WIRE_DTYPES[int(header[1])]
    out = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(out, src, group=group)
    return out


@torch.no_grad()
def forward_only(
    stages,
    owner: dict[int, int],
    n_microbatches: int,
    loss_fn,
    *args,
    target=None,
    losses: list | None = None,
    **kwargs,
):
    """Forward pass of every microbatch through all stages, no pipelining; same call as a
    schedule's `eval` (keyword arguments go to every stage, split into microbatches). Every
    rank walks (microbatch, stage) in the same order and only blocking sends/receives between
    owners of adjacent stages happen, so it cannot deadlock."""
    by_id = {s.stage_index: s for s in stages}
    group, me = stages[0].group, stages[0].group_rank
    num_stages, device = stages[0].num_stages, stages[0].device
    inputs = args[0].tensor_split(n_microbatches) if args else None
    targets = target.tensor_split(n_microbatches) if target is not None else None
    kwarg_mbs = {k: v.tensor_split(n_microbatches) for k, v in kwargs.items()}
    mb_losses = []
    for mb in range(n_microbatches):
        mb_kwargs = {k: v[mb] for k, v in kwarg_mbs.items()}
        x = None
        for sid in range(num_stages):
            if owner[sid] != me:
                continue
            if sid == 0:
                x = inputs[mb]
            elif owner[sid - 1] != me:
                x = _recv(group, owner[sid - 1], device)
            x = by_id[sid].submod(x, **mb_kwargs)
            if sid == num_stages - 1:  # logits may be a vocab-sharded DTensor (loss parallel)
                mb_losses.append(loss_fn(x, targets[mb]))
                continue
            if isinstance(x, DTensor):  # stages exchange local tensors, as PipelineStage does
                x = x.to_local()
            if owner[sid + 1] != me:
                _send(x, group, owner[sid + 1])
    if losses is not None and num_stages - 1 in by_id:
        losses.clear()
        losses.extend(mb_losses)


def stage_module_names(
    n_layers: int, parallelism, first: Sequence[str], last: Sequence[str]
) -> list[list[str]]:
    """Module names of every stage, in pipeline order: the planned `layers.<i>`, with the
    family's `first` modules (token embeddings) on the first stage and `last` ones (final
    norm, output projection) on the last."""
    plan = plan_stage_layers(
        n_layers,
        parallelism.pipeline_parallel_degree,
        parallelism.pipeline_parallel_schedule,
        layers_per_stage=parallelism.pipeline_parallel_layers_per_stage,
        split_points=parallelism.pipeline_parallel_split_points,
    )
    names = [[f"layers.{i}" for i in layers] for layers in plan]
    names[0][:0] = list(first)
    names[-1].extend(last)
    return names


def build_pipeline(
    model: nn.Module,
    parallel_dims,
    p: Parallelism,
    local_batch_size: int,
    device: torch.device,
    loss_fn,
    names: list[list[str]],
    parallelize: Callable[[nn.Module], nn.Module],
):
    """Splits the meta-device model into this rank's stages (`names` per stage), parallelizes
    each over the other mesh dimensions, and builds the `[parallelism]` section's schedule
    over microbatches of the `local_batch_size` sequences.

    Returns (model_parts, schedule, has_first_stage, has_last_stage)."""
    pp_mesh = parallel_dims.dim("pp")
    pp = pp_mesh.size()
    cls = schedule_class(p.pipeline_parallel_schedule)
    stage_ids = stage_ids_for_rank(pp_mesh.get_local_rank(), pp, len(names), is_v_schedule(cls))
    n_micro = microbatch_count(
        p.pipeline_parallel_schedule,
        local_batch_size,
        p.pipeline_parallel_microbatch_size,
        pp,
        len(names),
    )
    parts, stages = build_stages(model, names, stage_ids, pp_mesh.get_group(), device, parallelize)
    schedule = build_schedule(stages, p.pipeline_parallel_schedule, n_micro, loss_fn)
    return parts, schedule, any(s.is_first for s in stages), any(s.is_last for s in stages)
