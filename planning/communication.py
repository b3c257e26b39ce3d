"""Communication model: the bytes each rank sends per optimizer step along each mesh dimension,
the link that dimension uses, and the modelled compute time they hide behind (or not).

Ring collectives: an all-gather or reduce-scatter of a tensor of S bytes sends (n-1)/n S per
rank, an all-reduce twice that. Mesh order (outer to inner) pp, dp, cp, tp, so TP groups are the
closest ranks, CP groups the next (cp ranks tp apart). `tests/unit/test_estimate.py` checks the
bytes against the collectives of a real step.

Context parallelism (`Layout.cp`): each CP rank holds seq_len / cp tokens of every sequence;
per layer and micro-step attention all-gathers K and V over the cp ranks and reduce-scatters
their gradients in backward (`kv_all_gather_bytes`), on the critical path. The weights are the
same on CP ranks: FSDP shards them over the dp x cp ranks ("dp_shard_cp").

Mixture of experts (`Experts`): the EP ranks are the innermost data-parallel ranks (next to
TP, see `parallelisms/parallel_dims.py`), so an EP group spans ep x tp neighbouring ranks.
Per MoE layer and micro-batch each rank sends its tokens' top_k rows to the experts' owners
and gets the outputs back (`all_to_all_bytes`); the experts are FSDP-sharded over the
dp / ep ranks outside EP, and TP does not split them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
    """A mesh to model: degrees and how it trades memory for compute (`ep`: expert-parallel
    ranks drawn from the `dp` ones; `cp`: context-parallel ranks per sequence, world =
    tp x pp x dp x cp, `dp` ranks reading other sequences, FSDP over dp x cp)."""

    tp: int
    pp: int
    dp: int
    zero_stage: int = 3
    ac: str = "none"
    ep: int = 1
    cp: int = 1
    cp_method: str = "allgather"  # or "ulysses": all-to-all of q, k, v and the output

    @property
    def fsdp(self) -> int:
        """Ranks FSDP shards the weights over: the data-parallel and CP ranks together."""
        return self.dp * self.cp


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts model's experts: `layers` MoE layers of `n_experts` each, `top_k`
    chosen per token, `params` expert parameters in all (`planning.simulate.count_experts`)."""

    n_experts: int
    top_k: int
    layers: int
    params: int

    @property
    def active_params(self) -> float:
        """Expert parameters one token uses (top_k of n_experts in each MoE layer)."""
        return self.params * self.top_k / self.n_experts


def _link(stride: int, size: int, cluster: Cluster) -> tuple[str, float]:
    """A group of `size` ranks `stride` apart stays inside a node iff stride*size <= GPUs/node."""
    if stride * size <= cluster.gpus_per_node:
        return "NVLink", cluster.intra_bps
    return "network", cluster.inter_bps


def _comm(
    dim: str, stride: int, size: int, cluster: Cluster, nbytes: float, exposed: bool, what: str
) -> Comm:
    """A `Comm` over the link a group of `size` ranks `stride` apart uses."""
    link, bandwidth = _link(stride, size, cluster)
    return Comm(dim, size, link, nbytes, nbytes / bandwidth, exposed, what)


def _gathers(layout: Layout, stage_layers: int, accum: int, own_unit: bool) -> int:
    """Block-sized FSDP all-gathers per step: under PP one per block (kept gathered for the
    whole step); else per micro-step two per block (forward, backward) but one for the last
    block, kept from its forward into its backward; a unit of its own (the experts under EP)
    is freed after every forward, so gathered twice in every block."""
    if layout.pp > 1:
        return stage_layers
    return accum * (2 * stage_layers - (0 if own_unit else 1))


def _dp_comm(
    model_args,
    n_params: int,
    layout: Layout,
    cluster: Cluster,
    accum: int,
    param_bytes: int,
    reduce_bytes: int,
    experts: Experts | None = None,
) -> Comm:
    """The data-parallel dimension: FSDP's gathers and gradient reduce-scatter, or the
    all-reduce / reduce-scatter + all-gather of DDP and ZeRO-1/2 (overlapped with compute).
    Experts without EP travel here too, whole on every TP rank (TP does not split them)."""
    tp, pp, dp = layout.tp, layout.pp, layout.fsdp
    v, h = model_args.vocab_size, model_args.dim
    stage_layers = math.ceil(model_args.n_layers / pp)
    root = (2 * v * h + h) if pp == 1 else v * h  # one stage holds embedding or output
    expert_params = experts.params if experts is not None else 0
    block = (n_params - expert_params - 2 * v * h - h) / model_args.n_layers
    in_dp = expert_params / model_args.n_layers if layout.ep == 1 else 0.0
    frac = (dp - 1) / dp
    stage_params = (root + stage_layers * block) / tp + stage_layers * in_dp
    if layout.zero_stage == 3:
        g = _gathers(layout, stage_layers, accum, own_unit=False)
        gathered = (root * (accum if pp == 1 else 1) + g * block) / tp + g * in_dp
        nbytes = frac * (gathered * param_bytes + stage_params * reduce_bytes)
        what = (
            f"FSDP: all-gathers of {gathered / 1e9:.2f}B params + reduce-scatter "
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
    if layout.cp > 1:
        what = what.replace("FSDP:", f"FSDP over dp {layout.dp} x cp {layout.cp}:")
    return _comm("dp_shard_cp" if layout.cp > 1 else "dp", tp, dp, cluster, nbytes, False, what)


def _expert_fsdp_comm(
    model_args, layout: Layout, cluster: Cluster, experts: Experts, accum: int, pb: int, rb: int
) -> Comm | None:
    """Under EP the experts' own FSDP units over the dp / ep ranks outside EP ("dp_shard_mod_ep",
    ep x tp apart): each gathers this rank's 1/ep of a layer's experts; None on one rank."""
    size = layout.dp // layout.ep
    if size == 1:
        return None
    stage_layers = math.ceil(model_args.n_layers / layout.pp)
    share = experts.params / model_args.n_layers / layout.ep  # one layer's experts on this rank
    gathered = _gathers(layout, stage_layers, accum, own_unit=True) * share
    nbytes = (size - 1) / size * (gathered * pb + stage_layers * share * rb)
    what = (
        f"FSDP of the experts (1/{layout.ep} of each layer's): all-gathers of "
        f"{gathered / 1e9:.2f}B params + reduce-scatter of {stage_layers * share / 1e9:.2f}B "
        "gradients"
    )
    return _comm("dp_shard_mod_ep", layout.tp * layout.ep, size, cluster, nbytes, False, what)


def _stage_moe_layers(model_args, layout: Layout, experts: Experts | None) -> int:
    """MoE layers on one pipeline stage (their share of its layers)."""
    if experts is None:
        return 0
    stage_layers = math.ceil(model_args.n_layers / layout.pp)
    return math.ceil(experts.layers * stage_layers / model_args.n_layers)


def all_to_all_bytes(
    tokens: int, top_k: int, dim: int, ep: int, layers: int, param_bytes: int, recompute: bool
) -> float:
    """Bytes one rank sends per micro-step in the MoE all-to-alls: per MoE layer a dispatch
    (its `tokens` x `top_k` rows of `dim` values to the experts' ranks) and a combine (the
    outputs back) in forward, the same two in backward (their gradients), two more when full
    AC recomputes the forward; (ep - 1) / ep of the rows leave the rank (balanced routing)."""
    passes = 4 + (2 if recompute else 0)
    return passes * layers * tokens * top_k * dim * param_bytes * (ep - 1) / ep


def _ep_comm(
    model_args, layout: Layout, cluster: Cluster, experts: Experts, tokens: int, steps: int, pb: int
) -> Comm:
    """EP's all-to-alls over the ep ranks (tp apart), on the critical path: the experts wait
    for their rows. Under TP every TP rank routes the whole sequence (tokens not split)."""
    layers = _stage_moe_layers(model_args, layout, experts)
    full = layout.ac == "full"
    per_micro = all_to_all_bytes(tokens, experts.top_k, model_args.dim, layout.ep, layers, pb, full)
    rows = tokens * experts.top_k * model_args.dim * pb
    what = (
        f"EP: dispatch + combine all-to-alls of {tokens:,} tokens x top-{experts.top_k} rows "
        f"({rows / 2**20:.0f} MiB) per MoE layer and micro-batch, forward and backward"
        + (" and the full-AC recompute" if full else "")
    )
    return _comm("ep", layout.tp, layout.ep, cluster, per_micro * steps, True, what)


def kv_all_gather_bytes(
    seq_len: int, b: int, kv_dim: float, cp: int, layers: int, elem: int, recompute: bool
) -> float:
    """Bytes one rank sends per micro-step for CP's attention: per layer an all-gather of K
    and V ([b, seq_len, kv_dim] each, gathered from the rank's seq_len / cp tokens) in forward
    and a reduce-scatter of their gradients in backward, one more all-gather when full AC
    recomputes the forward; (cp - 1) / cp of each leaves the rank."""
    passes = 2 + (1 if recompute else 0)
    return passes * layers * 2 * b * seq_len * kv_dim * elem * (cp - 1) / cp


def ulysses_all_to_all_bytes(
    seq_len: int, b: int, q_dim: float, kv_dim: float, cp: int, layers: int, elem: int,
    recompute: bool,
) -> float:  # fmt: skip
    """Bytes one rank sends per micro-step for Ulysses CP: per layer all-to-alls of its q, k, v
    (sequence to head shards) and of the output (back), [b, seq_len / cp, dim] each, the same
    of their gradients in backward, once more in a full-AC recompute; (cp - 1) / cp of each
    leaves the rank, so the bytes per rank fall as 1/cp as cp grows (the all-gather's grow
    toward the whole sequence's K/V)."""
    passes = 2 + (1 if recompute else 0)
    per_pass = b * seq_len / cp * (2 * q_dim + 2 * kv_dim) * elem
    return passes * layers * per_pass * (cp - 1) / cp


def _cp_comm(
    model_args, layout: Layout, cluster: Cluster, seq_len: int, b: int, steps: int, pb: int
) -> Comm:
    """CP's K/V all-gathers and gradient reduce-scatters over the cp ranks (tp apart), on the
    critical path: attention waits for the gathered keys. TP splits the K/V heads."""
    layers = math.ceil(model_args.n_layers / layout.pp)
    kv_dim = model_args.n_kv_heads * model_args.head_dim / layout.tp
    full = layout.ac == "full"
    if layout.cp_method == "ulysses":
        q_dim = model_args.n_heads * model_args.head_dim / layout.tp
        per_micro = ulysses_all_to_all_bytes(seq_len, b, q_dim, kv_dim, layout.cp, layers, pb, full)
        what = "CP (Ulysses): all-to-all of q, k, v and the output per layer and micro-batch, "
        what += "and of their gradients in backward" + (
            ", again in the full-AC recompute" if full else ""
        )
        return _comm("cp", layout.tp, layout.cp, cluster, per_micro * steps, True, what)
    per_micro = kv_all_gather_bytes(seq_len, b, kv_dim, layout.cp, layers, pb, full)
    kv = 2 * b * seq_len * kv_dim * pb
    what = (
        f"CP: all-gather of K and V ({kv / 2**20:.0f} MiB gathered, {model_args.n_kv_heads} "
        "kv heads) per layer and micro-batch, their gradients reduce-scattered in backward"
        + (", again in the full-AC recompute" if full else "")
    )
    return _comm("cp", layout.tp, layout.cp, cluster, per_micro * steps, True, what)


def _tp_comm(
    layout: Layout,
    cluster: Cluster,
    act: float,
    stage_layers: int,
    micro_steps: int,
    moe_layers: int = 0,
) -> Comm:
    """TP with sequence parallelism, per layer and micro-batch: 2 all-gathers + 2
    reduce-scatters of the [b, s, h] activation `act` in forward, 4 in backward (+4 for a
    full AC recompute), plus the embedding's reduce-scatter and the output's all-gather.
    Of the `moe_layers` 2 fewer each way (one fewer in the recompute): the MoE layer
    all-gathers its input and keeps its sequence shard of the output (the TP ranks run the
    same tokens on unsplit experts, no reduce-scatter), backward all-gathers its output
    gradient."""
    tp = layout.tp
    full = layout.ac == "full"
    per_layer = 8 + (4 if full else 0)
    per_moe = per_layer - 2 - (1 if full else 0)
    ends = (2 if layout.pp == 1 else 1) * 2  # embedding RS / output AG, forward + backward
    count = per_layer * (stage_layers - moe_layers) + per_moe * moe_layers + ends
    nbytes = (tp - 1) / tp * act * count * micro_steps
    what = (
        f"TP+SP: {per_layer} all-gathers/reduce-scatters of a {act / 2**20:.0f} MiB "
        "activation per layer and micro-batch"
        + (f" ({per_moe} in each of {moe_layers} MoE layers)" if moe_layers else "")
    )
    return _comm("tp", 1, tp, cluster, nbytes, True, what)


def _pp_comm(layout: Layout, cluster: Cluster, act: float, micro_steps: int) -> Comm:
    """Pipeline send/recv of each micro-batch's (TP-sharded) activation and its gradient."""
    nbytes = 2 * micro_steps * (act / layout.tp)
    what = f"PP: send/recv of {micro_steps} micro-batch activations and their gradients"
    return _comm("pp", layout.tp * layout.fsdp, layout.pp, cluster, nbytes, True, what)


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
    experts: Experts | None = None,
) -> list[Comm]:
    """Bytes each rank sends per optimizer step along each mesh dimension and the time over
    the link that dimension uses.

    FSDP follows meshtrain's resharding: per micro-step the final norm + output unit and the
    embeddings (whose backward needs no weights) are gathered once, every block twice
    (forward, backward) except the last, which stays gathered; gradients are reduce-scattered
    once per step. Under PP parameters stay gathered for the whole step. TP, PP and EP move
    activations in the compute dtype (`param_bytes`), of the rank's seq_len / cp tokens; CP's
    K/V all-gathers are over the whole sequence. `experts`: a mixture-of-experts model (with
    `layout.ep` > 1, the experts' own FSDP traffic and EP's all-to-alls)."""
    out = []
    if layout.fsdp > 1:
        out.append(
            _dp_comm(
                model_args, n_params, layout, cluster, accum, param_bytes, reduce_bytes, experts
            )
        )
    pp = layout.pp
    b = microbatch if pp > 1 else local_batch
    micro_steps = accum * (max(1, local_batch // microbatch) if pp > 1 else 1)
    local = seq_len // layout.cp  # a CP rank's tokens of each sequence
    act = local * b * model_args.dim * param_bytes  # one [b, s/cp, h] activation
    if experts is not None and layout.ep > 1:
        expert_dp = _expert_fsdp_comm(
            model_args, layout, cluster, experts, accum, param_bytes, reduce_bytes
        )
        out += [expert_dp] if expert_dp is not None else []
        out.append(
            _ep_comm(model_args, layout, cluster, experts, local * b, micro_steps, param_bytes)
        )
    if layout.cp > 1:
        out.append(_cp_comm(model_args, layout, cluster, seq_len, b, micro_steps, param_bytes))
    if layout.tp > 1:
        stage_layers = math.ceil(model_args.n_layers / pp)
        moe = _stage_moe_layers(model_args, layout, experts)
        out.append(_tp_comm(layout, cluster, act, stage_layers, micro_steps, moe))
    if pp > 1:
        out.append(_pp_comm(layout, cluster, act, micro_steps))
    return out


def compute_seconds(
    fpt: float, tokens_per_rank: float, layout: Layout, cluster: Cluster, unsplit_fpt: float = 0.0
) -> float:
    """Model FLOPs / (peak x MFU), with full AC's extra forward (x 4/3). `tokens_per_rank`:
    a data-parallel rank's tokens, which its CP ranks split evenly (the load-balanced chunks
    give each the same share of causal attention). `unsplit_fpt`: the part of `fpt` that TP
    does not divide (MoE experts: every TP rank runs its experts on the whole sequence)."""
    tokens = tokens_per_rank / layout.cp
    flops = (fpt - unsplit_fpt) * tokens / (layout.tp * layout.pp)
    flops += unsplit_fpt * tokens / layout.pp
    if layout.ac == "full":
        flops *= 4 / 3
    return flops / (cluster.peak_tflops * 1e12 * cluster.mfu)
