"""Advice: a proposed mesh (TP x PP x CP x FSDP, AC mode; EP for a mixture of experts) for a
model on a cluster.

`advise` screens every layout with a fast memory formula (`analytic_memory`) and the
communication model (`planning.communication`), picks the fitting one with the fewest pipeline
stages and the fastest modelled step, and `explain` says why in words. The choice is then
checked with the real parallelize functions (`verification_config` + `planning.simulate`).
For a mixture of experts (`Workload.experts`) the search adds the EP degrees that divide the
experts and the data-parallel degree, EP groups inside a node first. Context parallelism: the
CP degrees that are powers of two dividing the ranks outside TP x PP and the sequence into
2 x cp chunks, CP groups (cp x tp neighbouring ranks) inside a node first; CP does not combine
with EP (`parallelisms.parallel_dims`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from planning.communication import (
    Cluster,
    Comm,
    Experts,
    Layout,
    comm_per_step,
    compute_seconds,
)
from planning.memory import GIB, attention_bytes, korthikanti_layer_bytes

_HEADROOM = 0.9  # a layout fits when its estimate stays under 90% of the device


@dataclass(frozen=True)
class Workload:
    """What to place: the model, its size and FLOPs per token, and the batch per step
    (`global_batch` sequences of `seq_len`, micro-batches of up to `micro_batch`;
    `document_mask`: attention takes an explicit document-causal mask)."""

    model_args: Any  # the family's args dataclass
    n_params: int
    flops_per_token: float
    seq_len: int
    global_batch: int
    block_bytes: Callable  # ModelSpec.block_activation_bytes
    micro_batch: int = 1
    experts: Experts | None = None  # a mixture of experts (`planning.simulate.count_experts`)
    document_mask: bool = False


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
    experts: Experts | None = None,
    document_mask: bool = False,
) -> int:
    """Fast per-rank estimate for the search (FSDP, bf16/fp32 as in meshtrain: 16 B/param
    sharded over tp*pp*dp*cp, plus working set and activations); `simulate` checks the choice.
    `experts` are not split by TP: sharded over pp*dp (EP x the ranks outside it), and a
    block's gathered experts are its EP share, 1/ep of them."""
    e = experts.params if experts is not None else 0
    per = (n_params - e) / (layout.tp * layout.pp) + e / layout.pp
    states = 16 * per / layout.fsdp
    block = (n_params - e - 2 * vocab * model_args.dim) / model_args.n_layers / layout.tp
    block += e / model_args.n_layers / layout.ep
    working = block * 2 * 2 + block * 6 + (2 * vocab * model_args.dim / layout.tp) * 2
    b = 1 if layout.pp > 1 else micro
    act = analytic_activations(model_args, layout, seq_len, b, vocab, block_bytes, document_mask)
    return int(states + working + act)


def analytic_activations(
    model_args,
    layout: Layout,
    seq_len: int,
    b: int,
    vocab: int,
    block_bytes: Callable,
    document_mask: bool = False,
) -> float:
    """Activations of a rank on the first stage (pp micro-batches in flight under 1F1B): its
    seq_len / cp tokens through the family's block count, CP's gathered K/V and the masks, full
    AC's kept layer inputs and one recomputed layer, and the logits."""
    tp, local = layout.tp, seq_len // layout.cp
    layers = math.ceil(model_args.n_layers / layout.pp)
    in_flight = layout.pp if layout.pp > 1 else 1
    attn = attention_bytes(model_args, seq_len, b, tp, layout.cp, document_mask=document_mask)
    whole = block_bytes(model_args, local, b, tp) + attn.per_layer
    kept, recomputed = whole, 0.0
    if layout.ac == "full":
        a = model_args.n_heads
        kept = korthikanti_layer_bytes(local, b, model_args.dim, a, tp, recompute="full")
        recomputed = whole  # the one layer being recomputed
    logits = 6 * local * b * vocab / tp
    return in_flight * (layers * kept + attn.mask_input) + recomputed + logits + attn.transient


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
    experts = work.experts
    mem = analytic_memory(
        args,
        work.n_params,
        layout,
        work.seq_len,
        micro,
        args.vocab_size,
        work.block_bytes,
        experts,
        work.document_mask,
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
        experts=experts,
    )
    unsplit = 6 * experts.active_params if experts is not None else 0.0  # experts: not TP-split
    comp = compute_seconds(work.flops_per_token, local * work.seq_len, layout, cluster, unsplit)
    bubble = comp * (pp - 1) / local if pp > 1 else 0.0
    return Candidate(layout, mem, comp, comms, bubble, micro, accum)


def _ep_degrees(work: Workload, cluster: Cluster, tp: int, dp: int, across: bool) -> list[int]:
    """EP degrees dividing the experts and the data-parallel degree whose EP group (ep x tp
    neighbouring ranks) stays inside a node, or (`across`) the larger ones; [1] / [] for a
    model without experts."""
    if work.experts is None:
        return [] if across else [1]
    n = work.experts.n_experts
    degrees = [e for e in range(1, min(n, dp) + 1) if n % e == 0 and dp % e == 0]
    return [e for e in degrees if (e * tp > cluster.gpus_per_node) == across]


def _cp_degrees(work: Workload, cluster: Cluster, tp: int, rest: int, across: bool) -> list[int]:
    """CP degrees > 1: powers of two dividing the `rest` ranks outside TP x PP, whose 2 x cp
    chunks split the sequence (and each rank's share the TP degree, for SP), with the CP group
    (cp x tp neighbouring ranks) inside a node, or (`across`) not."""
    degrees = [2**i for i in range(1, rest.bit_length()) if rest % 2**i == 0]
    return [
        c
        for c in degrees
        if work.seq_len % (2 * c) == 0
        and (work.seq_len // c) % tp == 0
        and (c * tp > cluster.gpus_per_node) == across
    ]


def _splits(work: Workload, cluster: Cluster, tp: int, rest: int, across: bool):
    """(dp, cp, ep) of the `rest` ranks outside TP x PP: CP 1 with each EP degree
    (`_ep_degrees`), then each CP degree (`_cp_degrees`) without EP."""
    out = [(rest, 1, ep) for ep in _ep_degrees(work, cluster, tp, rest, across)]
    return out + [(rest // cp, cp, 1) for cp in _cp_degrees(work, cluster, tp, rest, across)]


def _micro_batches(work: Workload, local: int, pp: int) -> list[int]:
    """Micro-batch sizes to try with `local` sequences per data-parallel rank (none when PP
    has fewer micro-batches than stages)."""
    if pp > 1:
        return [1] if local >= pp else []  # 1F1B needs at least as many micro-batches as stages
    top = max(d for d in range(1, min(local, work.micro_batch) + 1) if local % d == 0)
    return sorted({1, top})


def _candidates(
    work: Workload, cluster: Cluster, tp: int, pp: int, across: bool = False
) -> list[Candidate]:
    """Every CP and EP degree (`_splits`), micro-batch size and AC mode at TP `tp` x PP `pp` x
    FSDP (the rest); none when the degrees or the batch do not divide."""
    if cluster.world % (tp * pp):
        return []
    out = []
    for dp, cp, ep in _splits(work, cluster, tp, cluster.world // (tp * pp), across):
        if work.global_batch % dp:
            continue  # every data-parallel rank needs whole sequences
        local = work.global_batch // dp
        out += [
            _evaluate(work, cluster, Layout(tp, pp, dp, 3, ac, ep, cp), local, micro)
            for micro in _micro_batches(work, local, pp)
            for ac in ("none", "full")
        ]
    return out


def advise(work: Workload, cluster: Cluster) -> Advice:
    """Searches TP (within a node) x PP x CP x FSDP (the rest) and both AC modes at a fixed global
    batch of `work.global_batch` sequences (each data-parallel rank runs global_batch / dp of
    them in micro-batches of up to `work.micro_batch`; PP uses micro-batches of 1). Proposes
    the fitting layout with the fewest pipeline stages and the fastest modelled step. PP is
    used only when nothing fits without it (bubble, schedule constraints). With experts, EP
    groups (ep x tp ranks) stay inside a node unless nothing fits at that PP degree: the
    all-to-alls are per layer and on the critical path, so they need NVLink; so do CP groups
    (cp x tp ranks: their K/V all-gathers are per layer and exposed too)."""
    args = work.model_args
    tps = _tp_degrees(args, cluster.gpus_per_node)
    tried = []
    for pp in (p for p in (1, 2, 4, 8, 16, 32) if p <= args.n_layers):
        for across in (False, True):
            at_pp = [c for tp in tps for c in _candidates(work, cluster, tp, pp, across)]
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
    ] + ([_experts_line(work.experts)] if work.experts is not None else [])


def _experts_line(e: Experts) -> str:
    return (
        f"Experts: {e.layers} MoE layers x {e.n_experts} experts, top-{e.top_k} per token: "
        f"{e.params / 1e9:.1f}B expert params, {e.active_params / 1e9:.1f}B of them active per "
        f"token. EP degrees tried: those dividing {e.n_experts} and the FSDP degree, with EP x "
        "TP inside a node first."
    )


def format_candidates(advice: Advice, ep_columns: bool = False) -> list[str]:
    """One table row per candidate tried, the proposed one marked `<-`. `ep_columns` (a model
    with experts): the EP degree and EP's all-to-all time; the dp time then includes the
    experts' own FSDP traffic (over the ranks outside EP). The cp columns: the CP degree and its
    K/V all-gather time; dp counts the ranks reading other sequences, FSDP spans dp x cp."""
    ep_head, ep_comm_head = (f" {'ep':>3}", f" {'ep comm s':>9}") if ep_columns else ("", "")
    lines = [
        f"{'tp':>3} {'pp':>3} {'cp':>3}{ep_head} {'dp':>5} {'ac':>5} {'mb x acc':>8} "
        f"{'mem GiB':>8} {'compute s':>9} {'dp comm s':>9} {'tp comm s':>9} {'cp comm s':>9} "
        f"{'pp comm s':>9}{ep_comm_head} {'bubble s':>8} {'step s':>7}",
    ]
    for c in advice.tried:
        by = {x.dim: x.seconds for x in c.comms}
        dp_s = sum(v for k, v in by.items() if k.startswith("dp"))
        mark = " <-" if c is advice.best else ""
        lay = c.layout
        ep, ep_s = (f" {lay.ep:>3}", f" {by.get('ep', 0):>9.3f}") if ep_columns else ("", "")
        lines.append(
            f"{lay.tp:>3} {lay.pp:>3} {lay.cp:>3}{ep} {lay.dp:>5} {lay.ac:>5} "
            f"{f'{c.micro_batch}x{c.accum}':>8} {c.memory / GIB:>8.1f} {c.compute:>9.2f} "
            f"{dp_s:>9.3f} {by.get('tp', 0):>9.3f} {by.get('cp', 0):>9.3f} "
            f"{by.get('pp', 0):>9.3f}{ep_s} {c.bubble:>8.2f} {c.step:>7.2f}{mark}"
        )
    return lines


def _mesh(lay: Layout) -> str:
    """ "TP t x PP p x FSDP d", with " x CP c" under context parallelism and " (EP e of
    them)" under expert parallelism."""
    cp = f" x CP {lay.cp}" if lay.cp > 1 else ""
    return f"TP {lay.tp} x PP {lay.pp}{cp} x FSDP {lay.dp}" + (
        f" (EP {lay.ep} of them)" if lay.ep > 1 else ""
    )


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
    elif best.layout.cp == 1:
        lines.append("- No TP: FSDP alone fits memory, and its traffic hides behind compute.")
    return lines


def _alternatives(advice: Advice, cluster: Cluster, smallest_only: bool = False) -> list[str]:
    """The runner-up that fits and the layouts (up to the proposed PP) rejected for memory
    (`smallest_only`: one per mesh and AC mode, its smallest micro-batch's memory)."""
    best, lines = advice.best, []
    others = sorted(
        (c for c in advice.tried if c is not best and fits(c, cluster)),
        key=lambda c: (c.layout.pp, c.step),
    )
    if others:
        o = others[0]
        lines.append(
            f"- Runner-up: {_mesh(o.layout)}, AC {o.layout.ac}: {o.step:.2f} s per step"
            + (" (full AC recomputes the forward: +1/3 compute)" if o.layout.ac == "full" else "")
            + "."
        )
    unfit = [c for c in advice.tried if c.layout.pp <= best.layout.pp and not fits(c, cluster)]
    if smallest_only:
        by_mesh = {}
        for c in sorted(unfit, key=lambda c: -c.memory):
            by_mesh[(c.layout.tp, c.layout.pp, c.layout.cp, c.layout.ep, c.layout.ac)] = c
        unfit = [c for c in unfit if c in by_mesh.values()]
    if unfit:
        lines.append(
            "- Rejected for memory (> 90% of the device): "
            + ", ".join(
                f"TP {c.layout.tp}/PP {c.layout.pp}"
                + (f"/CP {c.layout.cp}" if c.layout.cp > 1 else "")
                + (f"/EP {c.layout.ep}" if c.layout.ep > 1 else "")
                + f"/AC {c.layout.ac} {c.memory / GIB:.0f} GiB"
                for c in unfit
            )
            + "."
        )
    return lines


def _ep_reasons(advice: Advice, cluster: Cluster, experts: Experts) -> list[str]:
    """Why this EP degree: what it saves and costs, and the best fitting step time of each
    other EP degree tried at the proposal's TP and PP."""
    lay, n = advice.best.layout, experts.n_experts
    group = lay.ep * lay.tp
    if lay.ep == 1:
        lines = [f"- No EP: every rank gathers all {n} experts of a layer and needs no all-to-all."]
    else:
        where = (
            f"inside a node ({lay.ep} x TP {lay.tp} = {group} <= {cluster.gpus_per_node} GPUs), "
            "so the all-to-alls, per MoE layer and on the critical path, run over NVLink"
            if group <= cluster.gpus_per_node
            else "across nodes: no layout with the EP group inside a node fits memory"
        )
        lines = [
            f"- EP {lay.ep}: each rank holds {n // lay.ep} of the {n} experts of every MoE layer, "
            f"so FSDP gathers 1/{lay.ep} of them (over the {lay.dp // lay.ep} ranks outside EP) "
            f"instead of all; the EP group stays {where}."
        ]
    same = [c for c in advice.tried if (c.layout.tp, c.layout.pp) == (lay.tp, lay.pp)]
    others = []
    for ep in sorted({c.layout.ep for c in same} - {lay.ep}):
        ok = [c.step for c in same if c.layout.ep == ep and fits(c, cluster)]
        others.append(f"EP {ep} " + (f"{min(ok):.2f} s" if ok else "does not fit"))
    if others:
        lines.append(f"- Other EP degrees at TP {lay.tp} x PP {lay.pp}: " + ", ".join(others) + ".")
    return lines


def _best_at(cands: list[Candidate], cluster: Cluster) -> str:
    """The fastest fitting step of `cands`, or the smallest memory when none fits."""
    ok = [c.step for c in cands if fits(c, cluster)]
    if ok:
        return f"{min(ok):.2f} s"
    return f"does not fit ({min(c.memory for c in cands) / GIB:.0f} GiB at best)"


def _cp_vs_tp(advice: Advice, cluster: Cluster) -> list[str]:
    """CP's K/V traffic against TP's activation traffic at the same degree (TP x CP ranks
    as TP alone, CP 1, the proposal's AC), where that layout was tried."""
    best = advice.best
    lay, by = best.layout, {c.dim: c for c in best.comms}
    degree = lay.tp * lay.cp
    rivals = [
        c
        for c in advice.tried
        if (c.layout.tp, c.layout.pp, c.layout.cp, c.layout.ac) == (degree, lay.pp, 1, lay.ac)
    ]
    if not rivals:
        return []
    rival = min(rivals, key=lambda c: c.step)
    tp = {c.dim: c for c in rival.comms}["tp"]
    cp = by["cp"]
    return [
        f"- CP {lay.cp} instead of TP {degree}: CP sends {cp.bytes / 1e9:.2f} GB per rank per step "
        f"({cp.seconds:.3f} s), only K and V with their few kv heads; TP {degree} (with SP) "
        f"sends {tp.bytes / 1e9:.2f} GB ({tp.seconds:.3f} s) in its all-gathers/reduce-scatters "
        f"of [b, s, dim] activations, several per layer; its step: {rival.step:.2f} s"
        + ("" if fits(rival, cluster) else f", and it does not fit ({rival.memory / GIB:.0f} GiB)")
        + "."
    ]


def _cp_reasons(advice: Advice, cluster: Cluster, work: Workload) -> list[str]:
    """Why this CP degree: what it divides and what it keeps whole, CP 1 at the same TP and
    PP, CP against TP of the same degree, and the other CP degrees tried."""
    lay, s = advice.best.layout, work.seq_len
    same = [
        c for c in advice.tried if (c.layout.tp, c.layout.pp, c.layout.ep) == (lay.tp, lay.pp, 1)
    ]
    degrees = sorted({c.layout.cp for c in same} - {lay.cp})
    others = ", ".join(
        f"CP {d} " + _best_at([c for c in same if c.layout.cp == d], cluster) for d in degrees
    )
    at = f"at TP {lay.tp} x PP {lay.pp}"
    if lay.cp == 1:
        return (
            [f"- No CP: one rank holds whole sequences; other CP degrees {at}: {others}."]
            if others
            else []
        )
    ctx = attention_bytes(
        work.model_args,
        s,
        advice.best.micro_batch,
        lay.tp,
        lay.cp,
        document_mask=work.document_mask,
    )
    mask = f" and the mask's copy ({ctx.mask / GIB:.2f} GiB)" if ctx.mask else ""
    lines = [
        f"- CP {lay.cp}: each rank holds {s // lay.cp:,} of every sequence's {s:,} tokens (2 x "
        f"{lay.cp} chunks, 2 per rank, for an even share of causal attention), so the "
        f"activations per rank fall by {lay.cp}x, except what attention keeps over all {s:,} keys "
        f"per layer: the gathered K and V at all heads ({ctx.kv / GIB:.2f} GiB more than the "
        f"local share){mask}; weights, gradients and AdamW are sharded over FSDP x CP = "
        f"{lay.fsdp} ranks."
    ]
    at_one = [c for c in same if c.layout.cp == 1]
    if at_one and not any(fits(c, cluster) for c in at_one):
        least = min(at_one, key=lambda c: c.memory)
        lines.append(
            f"- CP 1 {at}: does not fit; at best (AC {least.layout.ac}) {least.memory / GIB:.0f} "
            f"GiB per rank > 90% of {cluster.memory_gib:g} GiB."
        )
    lines += _cp_vs_tp(advice, cluster)
    return lines + [f"- Other CP degrees {at}: {others}."]


def explain(advice: Advice, cluster: Cluster, work: Workload | None = None) -> list[str]:
    """The proposal and why, in words (or that nothing fits); with `work`, why its CP degree
    and (a mixture of experts) its EP degree."""
    experts = work.experts if work is not None else None
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
        f"Proposed: {_mesh(lay)}, AC {lay.ac}.",
        "Why:",
        *_traffic_reasons(best),
        *(_ep_reasons(advice, cluster, experts) if experts is not None else []),
        *(_cp_reasons(advice, cluster, work) if work is not None else []),
        *_alternatives(advice, cluster, smallest_only=experts is not None),
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
    cfg.provenance.cli_keys |= chosen  # cfg is a deep copy: the caller's set is untouched
    return cfg


def verification_config(cfg, best: Candidate, global_batch: int):
    """A copy of `cfg` laid out as `best` proposes (FSDP over the rest, its CP and EP degrees,
    1F1B with micro-batches of 1 under PP), to check the proposal with the real parallelize
    functions."""
    lay = best.layout
    ep = (
        {}
        if lay.ep == cfg.parallelism.expert_parallel_degree
        else {"expert_parallel_degree": lay.ep}
    )
    vcfg = replace_parallelism(
        cfg,
        tensor_parallel_degree=lay.tp,
        pipeline_parallel_degree=lay.pp,
        data_parallel_shard_degree=-1,
        data_parallel_replicate_degree=1,
        context_parallel_degree=lay.cp,
        zero_stage=3,
        ac=lay.ac,
        **ep,
    )
    local = global_batch // lay.dp
    vcfg.training.local_batch_size = local if lay.pp > 1 else best.micro_batch
    vcfg.training.global_batch_size = global_batch
    if lay.pp > 1:
        vcfg.parallelism.pipeline_parallel_schedule = "1F1B"
        vcfg.parallelism.pipeline_parallel_layers_per_stage = -1
        vcfg.parallelism.pipeline_parallel_microbatch_size = 1
    return vcfg
