"""Advice: a proposed mesh (TP x PP x FSDP, AC mode) for a model on a cluster.

`advise` screens every layout with a fast memory formula (`analytic_memory`) and the
communication model (`planning.communication`), picks the fitting one with the fewest pipeline
stages and the fastest modelled step, and `explain` says why in words. The choice is then
checked with the real parallelize functions (`verification_config` + `planning.simulate`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from planning.communication import Cluster, Comm, Layout, comm_per_step, compute_seconds
from planning.memory import GIB, korthikanti_layer_bytes

_HEADROOM = 0.9  # a layout fits when its estimate stays under 90% of the device


@dataclass(frozen=True)
class Workload:
    """What to place: the model, its size and FLOPs per token, and the batch per step
    (`global_batch` sequences of `seq_len`, micro-batches of up to `micro_batch`)."""

    model_args: Any  # the family's args dataclass
    n_params: int
    flops_per_token: float
    seq_len: int
    global_batch: int
    block_bytes: Callable  # ModelSpec.block_activation_bytes
    micro_batch: int = 1


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


@dataclass
class Advice:
    """The proposed candidate (None when nothing fits) and every candidate tried, in order."""

    best: Candidate | None
    tried: list[Candidate]


def fits(candidate: Candidate, cluster: Cluster) -> bool:
    return candidate.memory <= _HEADROOM * cluster.memory_gib * GIB


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


# ------------------------------------------------------------------------------- search
def _tp_degrees(model_args, gpus_per_node: int) -> list[int]:
    """TP degrees that stay inside a node and divide the query and key/value heads."""
    return [
        t
        for t in (1, 2, 4, 8, 16)
        if t <= gpus_per_node
        and gpus_per_node % t == 0
        and model_args.n_heads % t == 0
        and model_args.kv_heads % t == 0
    ]


def _evaluate(
    work: Workload, cluster: Cluster, layout: Layout, local: int, micro: int
) -> Candidate:
    """The modelled memory, compute, traffic and bubble of `layout` with `local` sequences
    per data-parallel rank in micro-batches of `micro`."""
    pp = layout.pp
    accum = 1 if pp > 1 else local // micro
    args = work.model_args
    mem = analytic_memory(
        args, work.n_params, layout, work.seq_len, micro, args.vocab_size, work.block_bytes
    )
    comms = comm_per_step(
        args,
        work.n_params,
        layout,
        cluster,
        seq_len=work.seq_len,
        local_batch=local if pp > 1 else micro,
        accum=accum,
        microbatch=micro,
    )
    comp = compute_seconds(work.flops_per_token, local * work.seq_len, layout, cluster)
    bubble = comp * (pp - 1) / local if pp > 1 else 0.0
    return Candidate(layout, mem, comp, comms, bubble, micro, accum)


def _candidates(work: Workload, cluster: Cluster, tp: int, pp: int) -> list[Candidate]:
    """Every micro-batch size and AC mode at TP `tp` x PP `pp` x FSDP (the rest); none when
    the degrees or the batch do not divide."""
    world = cluster.world
    if world % (tp * pp):
        return []
    dp = world // (tp * pp)
    if work.global_batch % dp:
        return []  # every data-parallel rank needs whole sequences
    local = work.global_batch // dp
    if pp > 1:
        if local < pp:
            return []  # 1F1B needs at least as many micro-batches as stages
        micros = [1]
    else:
        top = max(d for d in range(1, min(local, work.micro_batch) + 1) if local % d == 0)
        micros = sorted({1, top})
    return [
        _evaluate(work, cluster, Layout(tp, pp, dp, 3, ac), local, micro)
        for micro in micros
        for ac in ("none", "full")
    ]


def advise(work: Workload, cluster: Cluster) -> Advice:
    """Searches TP (within a node) x PP x FSDP (the rest) and both AC modes at a fixed global
    batch of `work.global_batch` sequences (each data-parallel rank runs global_batch / dp of
    them in micro-batches of up to `work.micro_batch`; PP uses micro-batches of 1). Proposes
    the fitting layout with the fewest pipeline stages and the fastest modelled step. PP is
    used only when nothing fits without it (bubble, schedule constraints)."""
    args = work.model_args
    tps = _tp_degrees(args, cluster.gpus_per_node)
    tried = []
    for pp in (p for p in (1, 2, 4, 8, 16, 32) if p <= args.n_layers):
        at_pp = [c for tp in tps for c in _candidates(work, cluster, tp, pp)]
        tried += at_pp
        fitting = sorted((c for c in at_pp if fits(c, cluster)), key=lambda c: c.step)
        if fitting:
            return Advice(fitting[0], tried)
    return Advice(None, tried)


# ------------------------------------------------------------------------------- report
def format_header(model: str, work: Workload, cluster: Cluster) -> list[str]:
    """The problem in words: `model` (name and flavor), the batch and the cluster."""
    s, batch = work.seq_len, work.global_batch
    return [
        f"Advice for {model} ({work.n_params / 1e9:.1f}B params, seq_len {s}, global batch "
        f"{batch} sequences = {batch * s:,} tokens, micro-batch <= {work.micro_batch}) on "
        f"{cluster.nodes} node(s) x {cluster.gpus_per_node} GPUs ({cluster.world} ranks), "
        f"{cluster.memory_gib:g} GiB each.",
        f"Links: intra-node {cluster.intra_gbs:g} GB/s bidirectional -> "
        f"{cluster.intra_bps / 1e9:.0f} GB/s per direction x efficiency; inter-node "
        f"{cluster.inter_gbits:g} Gb/s per GPU -> {cluster.inter_bps / 1e9:.0f} GB/s. Compute: "
        f"{cluster.peak_tflops:g} TFLOP/s peak at {cluster.mfu:.0%} MFU.",
    ]


def format_candidates(advice: Advice) -> list[str]:
    """One table row per candidate tried, the proposed one marked `<-`."""
    lines = [
        f"{'tp':>3} {'pp':>3} {'dp':>5} {'ac':>5} {'mb x acc':>8} {'mem GiB':>8} {'compute s':>9} "
        f"{'dp comm s':>9} {'tp comm s':>9} {'pp comm s':>9} {'bubble s':>8} {'step s':>7}",
    ]
    for c in advice.tried:
        by = {x.dim: x.seconds for x in c.comms}
        mark = " <-" if c is advice.best else ""
        lay = c.layout
        lines.append(
            f"{lay.tp:>3} {lay.pp:>3} {lay.dp:>5} {lay.ac:>5} {f'{c.micro_batch}x{c.accum}':>8} "
            f"{c.memory / GIB:>8.1f} {c.compute:>9.2f} {by.get('dp', 0):>9.3f} "
            f"{by.get('tp', 0):>9.3f} {by.get('pp', 0):>9.3f} {c.bubble:>8.2f} {c.step:>7.2f}{mark}"
        )
    return lines


def _traffic_reasons(best: Candidate) -> list[str]:
    """Each mesh dimension's traffic of the proposed layout, and what TP is for."""
    lines = [
        f"- {c.dim} ({c.size} ranks over {c.link}): {c.what}: {c.bytes / 1e9:.2f} GB per "
        f"rank per step = {c.seconds:.3f} s, "
        + ("on the critical path." if c.exposed else "overlapped with compute.")
        for c in best.comms
    ]
    if best.layout.tp > 1:
        lines.append(
            f"- TP {best.layout.tp} stays inside a node: its traffic is per layer and exposed, "
            "so it needs NVLink; it divides the weights and activations by the TP degree."
        )
    else:
        lines.append("- No TP: FSDP alone fits memory, and its traffic hides behind compute.")
    return lines


def _alternatives(advice: Advice, cluster: Cluster) -> list[str]:
    """The runner-up that fits and the layouts (up to the proposed PP) rejected for memory."""
    best, lines = advice.best, []
    others = sorted(
        (c for c in advice.tried if c is not best and fits(c, cluster)),
        key=lambda c: (c.layout.pp, c.step),
    )
    if others:
        o = others[0]
        lines.append(
            f"- Runner-up: TP {o.layout.tp} x PP {o.layout.pp} x FSDP {o.layout.dp}, AC "
            f"{o.layout.ac}: {o.step:.2f} s per step"
            + (" (full AC recomputes the forward: +1/3 compute)" if o.layout.ac == "full" else "")
            + "."
        )
    unfit = [c for c in advice.tried if c.layout.pp <= best.layout.pp and not fits(c, cluster)]
    if unfit:
        lines.append(
            "- Rejected for memory (> 90% of the device): "
            + ", ".join(
                f"TP {c.layout.tp}/PP {c.layout.pp}/AC {c.layout.ac} {c.memory / GIB:.0f} GiB"
                for c in unfit
            )
            + "."
        )
    return lines


def explain(advice: Advice, cluster: Cluster) -> list[str]:
    """The proposal and why, in words (or that nothing fits)."""
    best = advice.best
    if best is None:
        return ["No layout fits: add GPUs, lower seq_len/local batch or use CPU offload."]
    lay = best.layout
    pp_reason = (
        "not needed (it costs a bubble and needs microbatches)."
        if lay.pp == 1
        else "needed, no layout with fewer stages fits memory."
    )
    return [
        "",
        f"Proposed: TP {lay.tp} x PP {lay.pp} x FSDP {lay.dp}, AC {lay.ac}.",
        "Why:",
        *_traffic_reasons(best),
        *_alternatives(advice, cluster),
        f"- PP {lay.pp}: {pp_reason}",
        f"- Step time model: {best.step:.2f} s (compute {best.compute:.2f} s).",
    ]


# ------------------------------------------------------------------------------- check
def replace_parallelism(cfg, **values):
    """A copy of `cfg` with `parallelism`/`activation_checkpoint` fields replaced."""
    cfg = copy.deepcopy(cfg)
    ac = values.pop("ac", None)
    cfg.parallelism = dataclasses.replace(cfg.parallelism, **values)
    chosen = {f"parallelism.{k}" for k in values}
    if ac is not None:
        cfg.activation_checkpoint = dataclasses.replace(cfg.activation_checkpoint, mode=ac)
        chosen.add("activation_checkpoint.mode")
    # chosen here as if on the command line: the config check then excuses the preset's values
    # that the new layout makes moot (a PP schedule under PP 1, an AC option with AC off)
    cfg._cli_keys = getattr(cfg, "_cli_keys", set()) | chosen
    return cfg


def verification_config(cfg, best: Candidate, global_batch: int):
    """A copy of `cfg` laid out as `best` proposes (FSDP over the rest, 1F1B with micro-batches
    of 1 under PP), to check the proposal with the real parallelize functions."""
    lay = best.layout
    vcfg = replace_parallelism(
        cfg,
        tensor_parallel_degree=lay.tp,
        pipeline_parallel_degree=lay.pp,
        data_parallel_shard_degree=-1,
        data_parallel_replicate_degree=1,
        zero_stage=3,
        ac=lay.ac,
    )
    local = global_batch // lay.dp
    vcfg.training.local_batch_size = local if lay.pp > 1 else best.micro_batch
    vcfg.training.global_batch_size = global_batch
    if lay.pp > 1:
        vcfg.parallelism.pipeline_parallel_schedule = "1F1B"
        vcfg.parallelism.pipeline_parallel_layers_per_stage = -1
        vcfg.parallelism.pipeline_parallel_microbatch_size = 1
    return vcfg
