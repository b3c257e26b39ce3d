"""Simulation: per-rank memory of a real layout, one simulated rank at a time, in one process.

`simulate` builds the real model on the meta device, joins a `fake` process group as one rank
of an N-rank world (no communication, nothing allocated), builds the real mesh and applies the
model's real parallelize function (or its pipeline split), then reads what each rank holds:
the local shards of the parameters, and from them gradients and AdamW state as the chosen
ZeRO stage keeps them, FSDP's gathered units in flight, and activations (`planning.memory`).

Expert parameters are those the parallelize function made DTensors on a mesh with an "ep"
dimension (`parallelisms.expert_parallel`): each EP rank holds 1/ep of every MoE layer's
experts, FSDP-sharded further over "dp_shard_mod_ep"; their FSDP unit is gathered over those
ranks only, which the DTensor placements tell `gathered_elements`. `count_experts` finds them
the same way for the analytic models (`planning.advise`).

This module imports no model: callers pass the model spec (`models.get_model_spec`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from models.contract import is_muon_matrix
from models.init_weights import canonical_name
from models.mixed_precision import in_weight_dtype, mixed_precision_dtypes
from parallelisms.decoder import AssemblyConfig, assemble_model
from parallelisms.parallel_dims import ParallelDims
from planning.communication import Experts
from planning.memory import GIB, layer_attention_specs, rank_activations

_STEP_BYTES = 4  # AdamW's per-parameter `step` counter (an fp32 scalar tensor)


@dataclass
class RankMemory:
    """What one rank holds, in bytes (see `simulate`)."""

    rank: int
    pp_rank: int
    layers: int
    local_params: int  # elements of this rank's parameter shards
    params: int
    grads: int
    optimizer: int
    working: int  # FSDP: gathered parameters/gradients of the blocks in flight
    activations: int
    notes: list[str] = field(default_factory=list)
    expert_bytes: int = 0  # of `params`: this rank's shards of the expert parameters
    expert_gathered: int = 0  # elements of one block's experts while gathered (its EP share)

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.states + self.working + self.activations


@dataclass
class Plan:
    """The result of `simulate`: the layout and one `RankMemory` per simulated rank."""

    dims: ParallelDims
    model_params: int
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    ranks: list[RankMemory]
    activation_formula: str
    optimizer: str = "AdamW"  # optimizer.name: AdamW/Adam 2 states, Muon 1 per matrix


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16", the spelling of `training.mixed_precision_*`."""
    return str(dtype).removeprefix("torch.")


# -------------------------------------------------------------- what a parallelized part holds
def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def on_ep_mesh(p: torch.Tensor) -> bool:
    """An expert parameter: a DTensor on a mesh with an "ep" dimension."""
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


def _dp_factor(p: torch.Tensor) -> int:
    """How many data-parallel shards a parameter is cut into (1 if not sharded on dp).

    FSDP2 over a TP-sharded DTensor whose TP placement cuts the same dim (ColwiseParallel's
    Shard(0), the vocab-sharded embedding and output) places it `_StridedShard` on the dp
    mesh dim, which is not a `Shard` subclass (torch 2.13: `isinstance` and `is_shard()` are
    both False), so it is named here as well."""
    if not isinstance(p, DTensor):
        return 1
    names = p.device_mesh.mesh_dim_names or ()
    factor = 1
    for i, placement in enumerate(p.placements):
        sharded = isinstance(placement, (Shard, _StridedShard))
        if sharded and i < len(names) and "dp" in names[i]:
            factor *= p.device_mesh.size(i)
    return factor


def gathered_elements(module: nn.Module | None) -> int:
    """Elements of `module`'s parameters one rank holds while FSDP has them all-gathered: its
    local shard times the data-parallel shards (TP shards stay cut; rank 0's shard is the
    largest, so this is FSDP's padded all-gather size)."""
    if module is None:
        return 0
    return sum(_local(p).numel() * _dp_factor(p) for p in module.parameters())


def state_bytes(part: nn.Module, muon=None) -> tuple[int, int, int, int]:
    """(local parameter elements, parameter, gradient, optimizer-state bytes) one rank holds
    for `part` after a step, read from the parallelized module itself. `muon`: (name,
    parameter) -> whether Muon holds it (one momentum buffer, no step counter), else AdamW.

    FSDP2 / TP / plain: the registered parameters are what the rank keeps (DTensor local
    shards); gradients have the same shape and dtype; AdamW keeps 2 states of each (and a step
    counter). ZeRO 0-2
    (`parallelisms.zero`): the full compute parameters in the compute dtype, plus an fp32
    master shard where the dtypes differ; stage 0/1 keep the full reduced gradient (stage 1
    as a view of which the optimizer sees one shard), stage 2 only the shard.
    """
    zero = getattr(part, "_zero", None)
    names = {id(p): canonical_name(n) for n, p in part.named_parameters()} if muon else {}

    def optim(p: torch.Tensor, local: torch.Tensor) -> int:
        if muon is not None and muon(names.get(id(p), ""), p):
            return local.numel() * local.element_size()
        return 2 * local.numel() * local.element_size() + _STEP_BYTES

    n_local = param_b = grad_b = optim_b = 0
    if zero is None:
        for p in part.parameters():
            loc = _local(p)
            n_local += loc.numel()
            param_b += loc.numel() * loc.element_size()
            grad_b += loc.numel() * loc.element_size()
            optim_b += optim(p, loc)
        return n_local, param_b, grad_b, optim_b
    pdt, rdt = zero.param_dtype.itemsize, zero.reduce_dtype.itemsize
    for p in zero.params:
        master = _local(p.master)
        msize = master.element_size()
        n_local += master.numel()
        full = _local(p.compute).numel()
        if zero.stage == 0:
            param_b += full * pdt + (0 if p.master is p.compute else full * msize)
            grad_b += full * msize
        else:
            param_b += p.buffer.numel() * pdt
            param_b += 0 if master.dtype == zero.param_dtype else master.numel() * msize
            shard = p.rows_per_rank * (full // max(1, _local(p.compute).shape[0]))
            if zero.stage == 1:  # the full reduced gradient stays alive behind the shard view
                grad_b += full * rdt if zero.reduce_dtype == master.dtype else shard * msize
            else:
                grad_b += shard * msize
        optim_b += optim(p.master, master)
    return n_local, param_b, grad_b, optim_b


def fsdp_working_bytes(part: nn.Module, spec, param_bytes: int, reduce_bytes: int) -> int:
    """FSDP2's transient memory at its largest moment, with `apply_fsdp`'s units. The final
    norm + output unit stays gathered from its forward into its backward, beside the last
    block (also kept) and its own unsharded gradients; in the middle of backward two blocks
    are gathered (the current one and the prefetched next) plus one block's unsharded
    gradients before their reduce-scatter (compute + reduce dtype); at the end of backward the
    embeddings' unsharded gradients (their weights are not gathered again)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(part, FSDPModule):
        return 0

    blocks = [gathered_elements(b) for b in part.layers.values()]
    big = max(blocks, default=0)
    emb = sum(gathered_elements(getattr(part, name, None)) for name in spec.embeddings)
    head = sum(gathered_elements(getattr(part, name, None)) for name in spec.head)
    with_grads = 2 * param_bytes + reduce_bytes  # gathered weights + unsharded gradients
    return max(
        head * with_grads + big * param_bytes,
        2 * big * param_bytes + big * (param_bytes + reduce_bytes),
        emb * (param_bytes + reduce_bytes),
    )


def _measure(
    parts: list[nn.Module],
    cfg,
    model_args,
    dims: ParallelDims,
    rank: int,
    dtypes: tuple[torch.dtype, torch.dtype],
    spec,
    scores_stored: bool,
    specs: tuple,
) -> RankMemory:
    """One simulated rank's `RankMemory`, from its parallelized model parts; `specs`: the
    whole model's distinct attention specs (a stage builds the block masks of all of them)."""
    block_bytes = spec.block_activation_bytes
    pp_rank = rank // (dims.world_size // dims.pp)
    param_bytes, reduce_bytes = (dtype.itemsize for dtype in dtypes)
    n_local = params = grads = optim = working = layers = 0
    has_output = False
    muon = None
    if cfg.optimizer.name == "Muon":
        muon = lambda name, p: is_muon_matrix(spec, name, p.ndim)  # noqa: E731
    for part in parts:
        n, pb, gb, ob = state_bytes(part, muon)
        n_local, params, grads, optim = n_local + n, params + pb, grads + gb, optim + ob
        working += fsdp_working_bytes(part, spec, param_bytes, reduce_bytes)
        layers += len(part.layers)
        has_output = has_output or getattr(part, spec.head[-1], None) is not None
    if block_bytes is None:
        act, note = 0, "activations not counted: the model family gives no block_activation_bytes"
    else:
        estimate = rank_activations(
            cfg, model_args, dims, pp_rank, layers, has_output, block_bytes, scores_stored, specs
        )
        act, note = estimate.total, estimate.describe()
    expert_bytes, expert_gathered, expert_note = _experts_held(parts, dims, param_bytes)
    notes = [note] + ([expert_note] if expert_note else [])
    return RankMemory(
        rank, pp_rank, layers, n_local, params, grads, optim, working, act, notes,
        expert_bytes, expert_gathered,
    )  # fmt: skip


def _experts_held(parts: list[nn.Module], dims: ParallelDims, param_bytes: int):
    """(bytes of this rank's expert parameter shards, elements of one block's experts while
    FSDP has them gathered (the largest), a note; 0, 0, None without EP)."""
    blocks = [b for part in parts for b in part.layers.values()]
    experts = [[p for p in b.parameters() if on_ep_mesh(p)] for b in blocks]
    if not any(experts):
        return 0, 0, None
    held = sum(_local(p).numel() * _local(p).element_size() for ps in experts for p in ps)
    gathered = max(sum(_local(p).numel() * _dp_factor(p) for p in ps) for ps in experts)
    note = (
        f"experts: 1/{dims.ep} of each MoE layer's on this EP rank, FSDP-sharded over the "
        f"{dims.dp_shard // dims.ep} rank(s) outside EP (dp_shard_mod_ep): "
        f"{held / GIB:.2f} GiB of the params column; one layer's gathered "
        f"{gathered * param_bytes / GIB:.2f} GiB ({gathered:,} elements, in the fsdp buf)"
    )
    return held, gathered, note


# ---------------------------------------------------------------------------- simulate
def _default_ranks(dims: ParallelDims, all_stages: bool) -> list[int]:
    """The first rank of the first, second and last pipeline stage (`all_stages`: of every
    stage)."""
    per_stage = dims.world_size // dims.pp
    stages = range(dims.pp) if all_stages else sorted({0, min(1, dims.pp - 1), dims.pp - 1})
    return [stage * per_stage for stage in stages]


def _activation_formula(scores_stored: bool) -> str:
    return (
        "per layer the model family's count of the tensors one block saves, in every AC mode "
        "(Llama: sb(24h + 4kv + 8f)/t, kv the K/V width; Korthikanti et al.'s GPT count: "
        "sbh(34/t + 5as/(ht)) with TP+SP); full AC keeps 2sbh/t; the block masks once per "
        "micro-batch, CP's gathered K/V at the K/V heads' size"
        + ("" if scores_stored else "; no 5as/h term: attention keeps no s x s scores")
    )


def _parallelized_parts(spec, model_args, cfg, dims: ParallelDims) -> list[nn.Module]:
    """The model parts this rank holds after the trainer's assembly (`assemble_model`), on
    the meta device; needs the rank's process group and `dims`' mesh."""
    with torch.device("meta"):
        model = in_weight_dtype(spec.model_cls(model_args), cfg.training)
    meta = torch.device("meta")
    options = AssemblyConfig.of(cfg)
    return assemble_model(model, spec, dims, options, meta, lambda out, target: out.sum()).parts


def simulate(
    spec,
    model_args,
    cfg,
    world_size: int,
    *,
    device_type: str = "cuda",
    ranks: list[int] | None = None,
    all_stages: bool = False,
    scores_stored: bool = False,
) -> Plan:
    """Per-rank memory of `cfg`'s layout on `world_size` ranks of `device_type` devices.

    Each simulated rank joins a fresh `fake` process group (FakeStore) as that rank, builds
    the mesh, builds `spec.model_cls(model_args)` on the meta device and assembles it with
    `assemble_model`, exactly what the trainer does. Default ranks: the first rank of the first, second and last
    pipeline stage (`all_stages`: of every stage); the other ranks of a stage hold the same
    sizes up to shard rounding, and middle stages lie between the first two in activations.
    `scores_stored`: count the s x s attention scores (an unfused attention kernel).
    """
    dtypes = mixed_precision_dtypes(cfg.training, device_type)
    cfg = copy.deepcopy(cfg)
    # the parts are built for "cpu": pin the compute dtype `device_type` resolves to
    cfg.training.mixed_precision_param = dtype_name(dtypes[0])
    dims = ParallelDims.from_parallelism(cfg.parallelism, world_size)
    with torch.device("meta"):
        whole = spec.model_cls(model_args)
    n_total = sum(x.numel() for x in whole.parameters())
    specs = tuple(dict.fromkeys(layer_attention_specs(whole)))
    out = []
    for rank in _default_ranks(dims, all_stages) if ranks is None else ranks:
        with _fake_rank(dims, rank):
            parts = _parallelized_parts(spec, model_args, cfg, dims)
            out.append(
                _measure(parts, cfg, model_args, dims, rank, dtypes, spec, scores_stored, specs)
            )
    return Plan(dims, n_total, *dtypes, out, _activation_formula(scores_stored), cfg.optimizer.name)


@contextlib.contextmanager
def _fake_rank(dims: ParallelDims, rank: int):
    """This process as `rank` of a fresh `fake` process group of `dims.world_size` ranks
    (FakeStore), with `dims`' mesh built on it; torn down on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulate() needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        dims.mesh = None
        dims.build_mesh("cpu")
        yield dims
    finally:
        dist.destroy_process_group()
        dims.mesh = None


def count_experts(spec, model_args, cfg) -> Experts | None:
    """The model's experts (None for a family without routing hooks or `n_experts`): the
    model is parallelized on meta as rank 0 of the smallest EP layout that splits its experts
    (FSDP x EP over as many ranks, no TP/PP/compile), and the parameters it made DTensors on
    the "ep" mesh are counted (global sizes), with the blocks holding them. `n_experts` and
    `top_k` are the family's args fields of those names."""
    n_experts = getattr(model_args, "n_experts", 0)
    if spec.routing is None or n_experts < 2:
        return None
    ep = min(d for d in range(2, n_experts + 1) if n_experts % d == 0)
    cfg = copy.deepcopy(cfg)
    cfg.parallelism = dataclasses.replace(
        cfg.parallelism,
        data_parallel_replicate_degree=1,
        data_parallel_shard_degree=ep,
        tensor_parallel_degree=1,
        pipeline_parallel_degree=1,
        expert_parallel_degree=ep,
        zero_stage=3,
    )
    cfg.compile.enable = False
    dims = ParallelDims.from_parallelism(cfg.parallelism, ep)
    with _fake_rank(dims, 0):
        (model,) = _parallelized_parts(spec, model_args, cfg, dims)
        per_block = [
            sum(p.numel() for p in block.parameters() if on_ep_mesh(p))
            for block in model.layers.values()
        ]
    layers = sum(1 for n in per_block if n)
    return Experts(n_experts, model_args.top_k, layers, sum(per_block)) if layers else None


def format_plan(plan: Plan, device_memory_gib: float) -> str:
    """A per-rank table in GiB and the verdict against `device_memory_gib`."""
    d = plan.dims
    lines = [
        f"layout: {d.describe()} | params {plan.model_params:,} | compute dtype "
        f"{dtype_name(plan.param_dtype)}, gradient reduction {dtype_name(plan.reduce_dtype)}, "
        + (
            "Muon (1 state per matrix, AdamW's 2 for the rest)"
            if plan.optimizer == "Muon"
            else "AdamW (2 fp32 states)"
        ),
        f"{'rank':>6} {'stage':>5} {'layers':>6} {'params':>9} {'grads':>9} {'optim':>9} "
        f"{'fsdp buf':>9} {'activ.':>9} {'total':>9}  vs {device_memory_gib:g} GiB",
    ]
    for r in plan.ranks:
        verdict = "fits" if r.total <= device_memory_gib * GIB else "DOES NOT FIT"
        if verdict == "fits" and r.total > 0.9 * device_memory_gib * GIB:
            verdict = "tight (>90%)"
        lines.append(
            f"{r.rank:>6} {r.pp_rank:>5} {r.layers:>6} "
            + " ".join(
                f"{v / GIB:>9.2f}"
                for v in (r.params, r.grads, r.optimizer, r.working, r.activations, r.total)
            )
            + f"  {verdict}"
        )
    lines.append(f"activations: {plan.activation_formula}")
    for r in plan.ranks:
        first, *more = r.notes or [""]
        lines.append(f"  rank {r.rank}: {first}")
        lines += [f"    {note}" for note in more]
    return "\n".join(lines)
