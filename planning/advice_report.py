"""The report of an advice (`planning.advise`): the problem in words, one table row per
layout tried, and why the proposed layout won, for `scripts/estimate.py --advise`."""

from __future__ import annotations

from planning.advise import Advice, Candidate, Workload, fits
from planning.communication import Cluster, Experts, Layout
from planning.memory import GIB, attention_bytes


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
    experts' own FSDP traffic (over the ranks outside EP). The cp columns: the CP degree ("u":
    Ulysses) and its K/V all-gather or all-to-all time; dp counts the ranks reading other sequences, FSDP spans dp x cp."""
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
            f"{lay.tp:>3} {lay.pp:>3} {_cp_cell(lay):>3}{ep} {lay.dp:>5} {lay.ac:>5} "
            f"{f'{c.micro_batch}x{c.accum}':>8} {c.memory / GIB:>8.1f} {c.compute:>9.2f} "
            f"{dp_s:>9.3f} {by.get('tp', 0):>9.3f} {by.get('cp', 0):>9.3f} "
            f"{by.get('pp', 0):>9.3f}{ep_s} {c.bubble:>8.2f} {c.step:>7.2f}{mark}"
        )
    return lines


def _cp_cell(lay: Layout) -> str:
    return f"{lay.cp}u" if lay.cp_method == "ulysses" else str(lay.cp)


def _mesh(lay: Layout) -> str:
    """ "TP t x PP p x FSDP d", with " x CP c" (and " (Ulysses)") under context parallelism
    and " (EP e of them)" under expert parallelism."""
    cp = (
        f" x CP {lay.cp}" + (" (Ulysses)" if lay.cp_method == "ulysses" else "")
        if lay.cp > 1
        else ""
    )
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
            lay = c.layout
            by_mesh[(lay.tp, lay.pp, lay.cp, lay.cp_method, lay.ep, lay.ac)] = c
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
        specs=work.attention,
    )
    mask = f" and its block masks ({ctx.masks / GIB:.3f} GiB)" if ctx.masks else ""
    lines = [
        f"- CP {lay.cp}: each rank holds {s // lay.cp:,} of every sequence's {s:,} tokens (2 x "
        f"{lay.cp} chunks, 2 per rank, for an even share of causal attention), so the "
        f"activations per rank fall by {lay.cp}x, except what attention keeps over all {s:,} keys "
        f"per layer: the gathered K and V at their own (K/V heads') size ({ctx.kv / GIB:.2f} GiB "
        f"more than the local share){mask}; weights, gradients and AdamW are sharded over FSDP x CP = "
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
