"""Communication model: the bytes each rank sends per optimizer step along each mesh dimension,
the link that dimension uses, and the modelled compute time they hide behind (or not).

Ring collectives: an all-gather or reduce-scatter of a tensor of S bytes sends (n-1)/n S per
rank, an all-reduce twice that. Mesh order (outer to inner) pp, dp, tp, so TP groups are the
closest ranks. `tests/test_estimate.py` checks the bytes against the collectives of a real step.
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
    """A mesh to model: degrees and how it trades memory for compute."""

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


def _comm(
    dim: str, stride: int, size: int, cluster: Cluster, nbytes: float, exposed: bool, what: str
) -> Comm:
    """A `Comm` over the link a group of `size` ranks `stride` apart uses."""
    link, bandwidth = _link(stride, size, cluster)
    return Comm(dim, size, link, nbytes, nbytes / bandwidth, exposed, what)


def _dp_comm(
    model_args,
    n_params: int,
    layout: Layout,
    cluster: Cluster,
    accum: int,
    param_bytes: int,
    reduce_bytes: int,
) -> Comm:
    """The data-parallel dimension: FSDP's gathers and gradient reduce-scatter, or the
    all-reduce / reduce-scatter + all-gather of DDP and ZeRO-1/2 (overlapped with compute)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    v, h = model_args.vocab_size, model_args.dim
    stage_layers = math.ceil(model_args.n_layers / pp)
    root = (2 * v * h + h) if pp == 1 else v * h  # one stage holds embedding or output
    block = (n_params - 2 * v * h - h) / model_args.n_layers
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
    return _comm("dp", tp, dp, cluster, nbytes, False, what)


def _tp_comm(
    layout: Layout, cluster: Cluster, act: float, stage_layers: int, micro_steps: int
) -> Comm:
    """TP with sequence parallelism, per layer and micro-batch: 2 all-gathers + 2
    reduce-scatters of the [b, s, h] activation `act` in forward, 4 in backward (+4 for a
    full AC recompute), plus the embedding's reduce-scatter and the output's all-gather."""
    tp = layout.tp
    per_layer = 8 + (4 if layout.ac == "full" else 0)
    ends = (2 if layout.pp == 1 else 1) * 2  # embedding RS / output AG, forward + backward
    nbytes = (tp - 1) / tp * act * (per_layer * stage_layers + ends) * micro_steps
    what = (
        f"TP+SP: {per_layer} all-gathers/reduce-scatters of a {act / 2**20:.0f} MiB "
        f"activation per layer and micro-batch"
    )
    return _comm("tp", 1, tp, cluster, nbytes, True, what)


def _pp_comm(layout: Layout, cluster: Cluster, act: float, micro_steps: int) -> Comm:
    """Pipeline send/recv of each micro-batch's (TP-sharded) activation and its gradient."""
    nbytes = 2 * micro_steps * (act / layout.tp)
    what = f"PP: send/recv of {micro_steps} micro-batch activations and their gradients"
    return _comm("pp", layout.tp * layout.dp, layout.pp, cluster, nbytes, True, what)


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
    the link that dimension uses.

    FSDP follows meshtrain's resharding: per micro-step the final norm + output unit and the
    embeddings (whose backward needs no weights) are gathered once, every block twice
    (forward, backward) except the last, which stays gathered; gradients are reduce-scattered
    once per step. Under PP parameters stay gathered for the whole step. TP and PP move
    activations in the compute dtype (`param_bytes`)."""
    out = []
    if layout.dp > 1:
        dp = _dp_comm(model_args, n_params, layout, cluster, accum, param_bytes, reduce_bytes)
        out.append(dp)
    pp = layout.pp
    b = microbatch if pp > 1 else local_batch
    micro_steps = accum * (max(1, local_batch // microbatch) if pp > 1 else 1)
    act = seq_len * b * model_args.dim * param_bytes  # one [b, s, h] activation
    if layout.tp > 1:
        stage_layers = math.ceil(model_args.n_layers / pp)
        out.append(_tp_comm(layout, cluster, act, stage_layers, micro_steps))
    if pp > 1:
        out.append(_pp_comm(layout, cluster, act, micro_steps))
    return out


def compute_seconds(fpt: float, tokens_per_rank: float, layout: Layout, cluster: Cluster) -> float:
    """Model FLOPs / (peak x MFU), with full AC's extra forward (x 4/3)."""
    flops = fpt * tokens_per_rank / (layout.tp * layout.pp)
    if layout.ac == "full":
        flops *= 4 / 3
    return flops / (cluster.peak_tflops * 1e12 * cluster.mfu)
