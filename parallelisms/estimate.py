"""Scale planning: per-rank memory of a real layout and per-step communication, in one process.

`simulate` builds the real model on the meta device, joins a `fake` process group as one rank
of an N-rank world (no communication, nothing allocated), builds the real mesh and applies the
model's real parallelize function (or its pipeline split), then reads what each rank holds:
the local shards of the parameters, and from them gradients and AdamW state as the chosen
ZeRO stage keeps them. Activations are estimated with Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", eqs. 1-2): sbh(34 + 5as/h) bytes per
layer, with tensor/sequence-parallel and recompute variants. `comm_per_step` and `advise`
are the communication model used to propose a mesh for a cluster.

This module imports no model: callers pass the model spec (`models.get_model_spec`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from parallelisms.parallel_dims import ParallelDims

GIB = float(1 << 30)
_BYTES = {"float32": 4, "bfloat16": 2}
_STEP_BYTES = 4  # AdamW's per-parameter `step` counter (an fp32 scalar tensor)


# ------------------------------------------------------------------------------ activations
def korthikanti_layer_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    *,
    sequence_parallel: bool = True,
    recompute: str = "none",
    scores_stored: bool = True,
) -> float:
    """Activation bytes one transformer layer keeps for backward (16-bit activations).

    none:      sbh(34 + 5as/h) without TP; sbh(34/t + 5as/(ht)) with TP + sequence parallel;
               sbh(10 + 24/t + 5as/(ht)) with TP alone.
    selective: the attention-score part (5as/h) is recomputed: sbh * 34/t (with SP).
    full:      only the layer input is kept: 2sbh (2sbh/t with SP).
    `scores_stored=False` drops the 5as/h term (fused attention such as the flash / memory
    efficient SDPA kernels keeps no s x s matrices, only the output and the log-sum-exp).
    """
    sbh = float(s) * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    scores = 5 * a * s / h if scores_stored and recompute != "selective" else 0.0
    if t == 1 or sequence_parallel:
        return sbh * (34 / t + scores / t)
    return sbh * (10 + 24 / t + scores / t)


def in_flight_microbatches(schedule: str, pp: int, pp_rank: int, n_micro: int) -> int:
    """Microbatches whose activations a pipeline rank holds at its peak: all of them for
    GPipe, pp - rank for 1F1B-style schedules (the first stage warms up with pp of them)."""
    if pp <= 1:
        return 1
    if schedule.lower().replace("schedule", "") == "gpipe":
        return n_micro
    return min(n_micro, pp - pp_rank)


# ------------------------------------------------------------------------------- per rank
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
    param_dtype: str
    reduce_dtype: str
    ranks: list[RankMemory]
    activation_formula: str


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


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


def state_bytes(part: nn.Module) -> tuple[int, int, int, int]:
    """(local parameter elements, parameter, gradient, AdamW-state bytes) one rank holds
    for `part` after a step, read from the parallelized module itself.

    FSDP2 / TP / plain: the registered parameters are what the rank keeps (DTensor local
    shards); gradients have the same shape and dtype; AdamW keeps 2 states of each (and a step
    counter). ZeRO 0-2
    (`parallelisms.zero`): the full compute parameters in the compute dtype, plus an fp32
    master shard where the dtypes differ; stage 0/1 keep the full reduced gradient (stage 1
    as a view of which the optimizer sees one shard), stage 2 only the shard.
    """
    zero = getattr(part, "_zero", None)
    n_local = param_b = grad_b = optim_b = 0
    if zero is None:
        for p in part.parameters():
            loc = _local(p)
            n_local += loc.numel()
            param_b += loc.numel() * loc.element_size()
            grad_b += loc.numel() * loc.element_size()
            optim_b += 2 * loc.numel() * loc.element_size() + _STEP_BYTES
        return n_local, param_b, grad_b, optim_b
    pdt = torch.empty((), dtype=zero.param_dtype).element_size()
    rdt = torch.empty((), dtype=zero.reduce_dtype).element_size()
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
            shard = p.rows_per_rank * (full // max(1, p.compute.shape[0]))
            if zero.stage == 1:  # the full reduced gradient stays alive behind the shard view
                grad_b += full * rdt if zero.reduce_dtype == master.dtype else shard * msize
            else:
                grad_b += shard * msize
        optim_b += 2 * master.numel() * msize + _STEP_BYTES
    return n_local, param_b, grad_b, optim_b


def fsdp_working_bytes(part: nn.Module, param_bytes: int, reduce_bytes: int) -> int:
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
    emb = gathered_elements(getattr(part, "tok_embeddings", None))
    head = gathered_elements(getattr(part, "norm", None))
    head += gathered_elements(getattr(part, "output", None))
    with_grads = 2 * param_bytes + reduce_bytes  # gathered weights + unsharded gradients
    return max(
        head * with_grads + big * param_bytes,
        2 * big * param_bytes + big * (param_bytes + reduce_bytes),
        emb * (param_bytes + reduce_bytes),
    )


def activation_bytes(
    cfg,
    model_args,
    dims: ParallelDims,
    pp_rank: int,
    layers: int,
    has_output: bool,
    block_bytes: Callable | None,
) -> tuple[int, str]:
    """Activation estimate for one rank (16-bit activations, fused attention by default);
    `block_bytes(args, seq_len, batch, tp)` is the family's count of what one block saves
    (`ModelSpec.block_activation_bytes`); without one, activations are not counted."""
    if block_bytes is None:
        return 0, "activations not counted: the model family gives no block_activation_bytes"
    t, p, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    s, h, a, tp = t.seq_len, model_args.dim, model_args.n_heads, dims.tp
    scores = getattr(cfg, "_estimate_scores_stored", False)
    if dims.pp > 1:
        b = p.pipeline_parallel_microbatch_size
        n_micro = max(1, t.local_batch_size // b)
        micro = in_flight_microbatches(p.pipeline_parallel_schedule, dims.pp, pp_rank, n_micro)
    else:
        b, micro = t.local_batch_size, 1
    mode = ac.mode
    if mode == "selective" and ac.selective_ac_option.isdigit():
        every = int(ac.selective_ac_option)
        full_layers = layers // every
    else:
        full_layers = layers if mode == "full" else 0
    kept = layers - full_layers
    rec = "selective" if mode == "selective" and not ac.selective_ac_option.isdigit() else "none"
    korth = korthikanti_layer_bytes(s, b, h, a, tp, recompute=rec, scores_stored=scores)
    whole = block_bytes(model_args, s, b, tp)
    if scores:
        whole += korthikanti_layer_bytes(s, b, h, a, tp) - korthikanti_layer_bytes(
            s, b, h, a, tp, scores_stored=False
        )
    per_layer = korth if rec == "selective" else whole
    per_full = korthikanti_layer_bytes(s, b, h, a, tp, recompute="full")
    total = micro * (kept * per_layer + full_layers * per_full)
    recompute = 0.0
    if full_layers:  # backward recomputes one checkpointed layer at a time
        recompute = whole
        total += recompute
    logits = 0.0
    if has_output:  # bf16 logits + fp32 copy for the cross-entropy, vocab-sharded under TP
        logits = micro * s * b * model_args.vocab_size / tp * (2 + 4)
    text = (
        f"s={s} b={b} h={h} a={a} t={tp} (Korthikanti {korth / GIB:.3f} GiB/layer, "
        f"the family's block count {whole / GIB:.3f}): "
        + (f"{kept} layers x {per_layer / GIB:.3f} GiB" if kept else "")
        + (" + " if kept and full_layers else "")
        + (f"{full_layers} checkpointed x {per_full / GIB:.3f} GiB" if full_layers else "")
        + (f", x {micro} microbatches in flight" if micro > 1 else "")
        + (f", + 1 layer recomputed {recompute / GIB:.3f} GiB" if recompute else "")
        + (f", logits {logits / GIB:.2f} GiB" if logits else "")
    )
    return int(total + logits), text


# ------------------------------------------------------------------------------- simulate
def resolved_dtypes(training_cfg, device_type: str) -> tuple[str, str]:
    param = training_cfg.mixed_precision_param
    if param == "auto":
        param = "bfloat16" if device_type == "cuda" else "float32"
    return param, training_cfg.mixed_precision_reduce


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
    the mesh, builds `spec.model_cls(model_args)` on the meta device and applies
    `spec.parallelize_fn` (or `spec.pipeline_fn` when pipeline_parallel_degree > 1), exactly
    what the trainer does. Default ranks: the first rank of the first, second and last
    pipeline stage (`all_stages`: of every stage); the other ranks of a stage hold the same
    sizes up to shard rounding, and middle stages lie between the first two in activations.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulate() needs a process without a process group")
    cfg = copy.deepcopy(cfg)
    pdt, rdt = resolved_dtypes(cfg.training, device_type)
    cfg.training.mixed_precision_param = pdt
    cfg._estimate_scores_stored = scores_stored
    p = cfg.parallelism
    dims = ParallelDims.from_parallelism(p, world_size)
    per_stage = world_size // dims.pp
    if ranks is None:
        stages = range(dims.pp) if all_stages else sorted({0, min(1, dims.pp - 1), dims.pp - 1})
        ranks = [stage * per_stage for stage in stages]
    with torch.device("meta"):
        n_total = sum(x.numel() for x in spec.model_cls(model_args).parameters())
    out = []
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            dims.mesh = None
            dims.build_mesh("cpu")
            with torch.device("meta"):
                model = spec.model_cls(model_args)
            if dims.pp_enabled:
                parts, _, _, _ = spec.pipeline_fn(
                    model, dims, cfg, torch.device("meta"), lambda out, target: out.sum()
                )
            else:
                parts = [spec.parallelize_fn(model, dims, cfg, "cpu")]
            out.append(
                _measure(parts, cfg, model_args, dims, rank, pdt, rdt, spec.block_activation_bytes)
            )
        finally:
            dist.destroy_process_group()
            dims.mesh = None
    formula = (
        "per layer the model family's count of the tensors one block saves (Llama: "
        "sbh(28 + 8f/h)/t; Korthikanti et al.'s GPT count: sbh(34/t + 5as/(ht)) with TP+SP); "
        "full AC keeps 2sbh/t"
        + ("" if scores_stored else "; no 5as/h term: fused SDPA keeps no s x s scores")
    )
    return Plan(dims, n_total, pdt, rdt, out, formula)


def _measure(parts, cfg, model_args, dims, rank, pdt, rdt, block_bytes) -> RankMemory:
    pp_rank = rank // (dims.world_size // dims.pp)
    n_local = params = grads = optim = working = layers = 0
    has_output = False
    for part in parts:
        n, pb, gb, ob = state_bytes(part)
        n_local, params, grads, optim = n_local + n, params + pb, grads + gb, optim + ob
        working += fsdp_working_bytes(part, _BYTES[pdt], _BYTES[rdt])
        layers += len(part.layers)
        has_output = has_output or getattr(part, "output", None) is not None
    act, text = activation_bytes(cfg, model_args, dims, pp_rank, layers, has_output, block_bytes)
    return RankMemory(rank, pp_rank, layers, n_local, params, grads, optim, working, act, [text])


def format_plan(plan: Plan, device_memory_gib: float) -> str:
    """A per-rank table in GiB and the verdict against `device_memory_gib`."""
    d = plan.dims
    lines = [
        f"layout: {d.describe()} | params {plan.model_params:,} | compute dtype "
        f"{plan.param_dtype}, gradient reduction {plan.reduce_dtype}, AdamW (2 fp32 states)",
        f"{'rank':>6} {'stage':>5} {'layers':>6} {'params':>9} {'grads':>9} {'adamw':>9} "
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
        lines.append(f"  rank {r.rank}: {'; '.join(r.notes)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- ZeRO arithmetic
def zero_bytes_per_param(stage: int, n: int) -> tuple[float, str]:
    """Mixed-precision AdamW bytes per parameter per GPU (ZeRO paper: 2 bf16 weights + 2 bf16
    gradients + 12 fp32 optimizer state = master weights, momentum, variance)."""
    if stage == 0:
        return 16.0, "2 + 2 + 12"
    if stage == 1:
        return 4 + 12 / n, f"2 + 2 + 12/{n}"
    if stage == 2:
        return 2 + 14 / n, f"2 + (2 + 12)/{n}"
    return 16 / n, f"(2 + 2 + 12)/{n}"


# ---------------------------------------------------------------------- communication
@dataclass
class Cluster:
    """Hardware for the communication model. Bandwidths as vendors quote them: NVLink per
    GPU both directions together (GB/s), the network per GPU (Gb/s); a ring moves data one
    way, so intra = intra_gbs / 2, inter = inter_gbits / 8, both times `efficiency`."""

    gpus_per_node: int = 8
    nodes: int = 1
    intra_gbs: float = 900.0
    inter_gbits: float = 400.0
    memory_gib: float = 80.0
    peak_tflops: float = 989.0
    mfu: float = 0.4
    efficiency: float = 0.8

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def intra_bps(self) -> float:
        return self.intra_gbs / 2 * 1e9 * self.efficiency

    @property
    def inter_bps(self) -> float:
        return self.inter_gbits / 8 * 1e9 * self.efficiency


@dataclass
class Comm:
    """One mesh dimension's traffic per optimizer step, per rank."""

    dim: str
    size: int
    link: str
    bytes: float
    seconds: float
    exposed: bool  # on the critical path (not overlapped with compute)
    what: str


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int
    zero_stage: int = 3
    ac: str = "none"


def _link(stride: int, size: int, cluster: Cluster) -> tuple[str, float]:
    """A group of `size` ranks `stride` apart stays inside a node iff stride*size <= GPUs/node."""
    if stride * size <= cluster.gpus_per_node:
        return "NVLink", cluster.intra_bps
    return "network", cluster.inter_bps


def comm_per_step(
    model_args,
    n_params: int,
    layout: Layout,
    cluster: Cluster,
    *,
    seq_len: int,
    local_batch: int,
    accum: int = 1,
    microbatch: int = 1,
    param_bytes: int = 2,
    reduce_bytes: int = 4,
) -> list[Comm]:
    """Bytes each rank sends per optimizer step along each mesh dimension and the time over
    the link that dimension uses. Ring collectives: an all-gather or reduce-scatter of a
    tensor of S bytes sends (n-1)/n S per rank, an all-reduce twice that. Mesh order (outer
    to inner) pp, dp, tp, so TP groups are the closest ranks.

    FSDP follows meshtrain's resharding: per micro-step the final norm + output unit and the
    embeddings (whose backward needs no weights) are gathered once, every block twice
    (forward, backward) except the last, which stays gathered; gradients are reduce-scattered
    once per step. Under PP parameters stay gathered for the whole step. TP with sequence
    parallelism: per layer and micro-batch, 2 all-gathers + 2 reduce-scatters of a [b, s, h]
    activation in forward and 4 in backward (+4 for a full AC recompute), plus the
    embedding's reduce-scatter and the output's all-gather."""
    out = []
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    s, h, v, n_layers = seq_len, model_args.dim, model_args.vocab_size, model_args.n_layers
    stage_layers = math.ceil(n_layers / pp)
    root = (2 * v * h + h) if pp == 1 else v * h  # one stage holds embedding or output
    block = (n_params - 2 * v * h - h) / n_layers
    act_bytes = param_bytes
    if dp > 1:
        link, bw = _link(tp, dp, cluster)
        frac = (dp - 1) / dp
        stage_params = (root + stage_layers * block) / tp
        if layout.zero_stage == 3:
            gathered = (
                (root + stage_layers * block)
                if pp > 1
                else accum * (root + (2 * stage_layers - 1) * block)
            )
            nbytes = frac * (gathered / tp * param_bytes + stage_params * reduce_bytes)
            what = (
                f"FSDP: all-gathers of {gathered / tp / 1e9:.2f}B params + reduce-scatter "
                f"of {stage_params / 1e9:.2f}B gradients"
            )
        elif layout.zero_stage == 0:
            nbytes, what = 2 * frac * stage_params * reduce_bytes, "DDP: gradient all-reduce"
        elif layout.zero_stage == 1:
            nbytes = frac * stage_params * (2 * reduce_bytes + param_bytes)
            what = "ZeRO-1: gradient all-reduce + parameter all-gather"
        else:
            nbytes = frac * stage_params * (reduce_bytes + param_bytes)
            what = "ZeRO-2: gradient reduce-scatter + parameter all-gather"
        out.append(Comm("dp", dp, link, nbytes, nbytes / bw, False, what))
    b = microbatch if pp > 1 else local_batch
    micro_steps = accum * (max(1, local_batch // microbatch) if pp > 1 else 1)
    if tp > 1:
        link, bw = _link(1, tp, cluster)
        per_layer = 8 + (4 if layout.ac == "full" else 0)
        act = s * b * h * act_bytes  # one [b, s, h] activation
        ends = (2 if pp == 1 else 1) * 2  # embedding RS / output AG, forward + backward
        nbytes = (tp - 1) / tp * act * (per_layer * stage_layers + ends) * micro_steps
        what = (
            f"TP+SP: {per_layer} all-gathers/reduce-scatters of a {act / 2**20:.0f} MiB "
            f"activation per layer and micro-batch"
        )
        out.append(Comm("tp", tp, link, nbytes, nbytes / bw, True, what))
    if pp > 1:
        link, bw = _link(tp * dp, pp, cluster)
        act = s * b * h * act_bytes / tp
        nbytes = 2 * micro_steps * act
        what = f"PP: send/recv of {micro_steps} micro-batch activations and their gradients"
        out.append(Comm("pp", pp, link, nbytes, nbytes / bw, True, what))
    return out


def compute_seconds(fpt: float, tokens_per_rank: float, layout: Layout, cluster: Cluster) -> float:
    """Model FLOPs / (peak x MFU), with full AC's extra forward (x 4/3)."""
    flops = fpt * tokens_per_rank / (layout.tp * layout.pp)
    if layout.ac == "full":
        flops *= 4 / 3
    return flops / (cluster.peak_tflops * 1e12 * cluster.mfu)


@dataclass
class Candidate:
    layout: Layout
    memory: int
    compute: float
    comms: list[Comm]
    bubble: float
    micro_batch: int = 1
    accum: int = 1

    @property
    def step(self) -> float:
        overlapped = sum(c.seconds for c in self.comms if not c.exposed)
        exposed = sum(c.seconds for c in self.comms if c.exposed)
        return self.compute + max(0.0, overlapped - self.compute) + exposed + self.bubble


def analytic_memory(
    model_args,
    n_params: int,
    layout: Layout,
    seq_len: int,
    micro: int,
    vocab: int,
    block_bytes: Callable,
) -> int:
    """Fast per-rank estimate for the search (FSDP, bf16/fp32 as in meshtrain: 16 B/param
    sharded over tp*pp*dp, plus working set and activations); `simulate` checks the choice."""
    per = n_params / (layout.tp * layout.pp)
    states = 16 * per / layout.dp
    block = (n_params - 2 * vocab * model_args.dim) / model_args.n_layers / layout.tp
    working = block * 2 * 2 + block * 6 + (2 * vocab * model_args.dim / layout.tp) * 2
    layers = math.ceil(model_args.n_layers / layout.pp)
    b = 1 if layout.pp > 1 else micro
    in_flight = layout.pp if layout.pp > 1 else 1
    a = model_args.n_heads
    rec = "full" if layout.ac == "full" else "none"
    whole = block_bytes(model_args, seq_len, b, layout.tp)
    per_layer = (
        whole
        if rec == "none"
        else korthikanti_layer_bytes(seq_len, b, model_args.dim, a, layout.tp, recompute="full")
    )
    act = in_flight * layers * per_layer + 6 * seq_len * b * vocab / layout.tp
    if rec == "full":
        act += whole  # the one layer being recomputed
    return int(states + working + act)


def advise(
    model_args,
    n_params: int,
    fpt: float,
    cluster: Cluster,
    *,
    seq_len: int,
    global_batch: int,
    block_bytes: Callable,
    micro_batch: int = 1,
) -> tuple[Candidate | None, list[Candidate]]:
    """Searches TP (within a node) x PP x FSDP (the rest) and both AC modes at a fixed global
    batch of `global_batch` sequences (each data-parallel rank runs global_batch / dp of them
    in micro-batches of up to `micro_batch`; PP uses micro-batches of 1). Returns the fitting
    layout with the fewest pipeline stages and the fastest modelled step, and every candidate
    tried. PP is used only when nothing fits without it (bubble, schedule constraints)."""
    world, g = cluster.world, cluster.gpus_per_node
    tps = [
        t
        for t in (1, 2, 4, 8, 16)
        if t <= g and g % t == 0 and model_args.n_heads % t == 0 and model_args.kv_heads % t == 0
    ]
    pps = [p for p in (1, 2, 4, 8, 16, 32) if p <= model_args.n_layers]
    tried = []
    for pp in pps:
        fits = []
        for tp in tps:
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue  # every data-parallel rank needs whole sequences
            local = global_batch // dp
            if pp > 1:
                if local < pp:
                    continue  # 1F1B needs at least as many micro-batches as stages
                micros = [1]
            else:
                top = max(d for d in range(1, min(local, micro_batch) + 1) if local % d == 0)
                micros = sorted({1, top})
            for micro, ac in [(m, a) for m in micros for a in ("none", "full")]:
                accum = 1 if pp > 1 else local // micro
                lay = Layout(tp, pp, dp, 3, ac)
                mem = analytic_memory(
                    model_args, n_params, lay, seq_len, micro, model_args.vocab_size, block_bytes
                )
                comms = comm_per_step(
                    model_args,
                    n_params,
                    lay,
                    cluster,
                    seq_len=seq_len,
                    local_batch=local if pp > 1 else micro,
                    accum=accum,
                    microbatch=micro,
                )
                comp = compute_seconds(fpt, local * seq_len, lay, cluster)
                bubble = comp * (pp - 1) / local if pp > 1 else 0.0
                cand = Candidate(lay, mem, comp, comms, bubble, micro, accum)
                tried.append(cand)
                if mem <= 0.9 * cluster.memory_gib * GIB:
                    fits.append(cand)
        if fits:
            fits.sort(key=lambda c: c.step)
            return fits[0], tried
    return None, tried


def replace_parallelism(cfg, **values):
    """A copy of `cfg` with `parallelism`/`activation_checkpoint` fields replaced."""
    cfg = copy.deepcopy(cfg)
    ac = values.pop("ac", None)
    cfg.parallelism = dataclasses.replace(cfg.parallelism, **values)
    if ac is not None:
        cfg.activation_checkpoint = dataclasses.replace(cfg.activation_checkpoint, mode=ac)
    return cfg
