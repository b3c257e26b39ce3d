"""Advice: a proposed mesh (TP x PP x CP x FSDP, AC mode; EP for a mixture of experts) for a
model on a cluster.

`advise` screens every layout with a fast memory formula (`analytic_memory`) and the
communication model (`planning.communication`), picks the fitting one with the fewest pipeline
stages and the fastest modelled step; `planning.advice_report` says why in words. The choice
is then checked with the real parallelize functions (`verification_config` +
`planning.simulate`).
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

from models.attention import AttentionSpec
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
    `document_mask`: attention masks documents; `attention`: the model's distinct attention
    specs, whose block masks it builds per micro-batch)."""

    model_args: Any  # the family's args dataclass
    n_params: int
    flops_per_token: float
    seq_len: int
    global_batch: int
    block_bytes: Callable  # ModelSpec.block_activation_bytes
    micro_batch: int = 1
    experts: Experts | None = None  # a mixture of experts (`planning.simulate.count_experts`)
    document_mask: bool = False
    attention: tuple[AttentionSpec, ...] = (AttentionSpec(),)


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
    specs: tuple[AttentionSpec, ...] = (AttentionSpec(),),
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
    act = analytic_activations(
        model_args, layout, seq_len, b, vocab, block_bytes, document_mask, specs
    )
    return int(states + working + act)


def analytic_activations(
    model_args,
    layout: Layout,
    seq_len: int,
    b: int,
    vocab: int,
    block_bytes: Callable,
    document_mask: bool = False,
    specs: tuple[AttentionSpec, ...] = (AttentionSpec(),),
) -> float:
    """Activations of a rank on the first stage (pp micro-batches in flight under 1F1B): its
    seq_len / cp tokens through the family's block count, CP's gathered K/V and the block
    masks of `specs`, full AC's kept layer inputs and one recomputed layer, and the logits."""
    tp, local = layout.tp, seq_len // layout.cp
    layers = math.ceil(model_args.n_layers / layout.pp)
    in_flight = layout.pp if layout.pp > 1 else 1
    attn = attention_bytes(
        model_args, seq_len, b, tp, layout.cp, document_mask=document_mask, specs=specs,
        method=layout.cp_method,
    )  # fmt: skip
    whole = block_bytes(model_args, local, b, tp) + attn.per_layer
    kept, recomputed = whole, 0.0
    if layout.ac == "full":
        a = model_args.n_heads
        kept = korthikanti_layer_bytes(local, b, model_args.dim, a, tp, recompute="full")
        recomputed = whole  # the one layer being recomputed
    logits = 6 * local * b * vocab / tp
    return in_flight * (layers * kept + attn.masks) + recomputed + logits + attn.transient


# ------------------------------------------------------------------------------- search
def _tp_degrees(model_args, gpus_per_node: int) -> list[int]:
    """TP degrees that stay inside a node and divide the query and key/value heads."""
    return [
        t
        for t in (1, 2, 4, 8, 16)
        if t <= gpus_per_node
        and gpus_per_node % t == 0
        and model_args.n_heads % t == 0
        and model_args.n_kv_heads % t == 0
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
        work.attention,
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
    """Every CP and EP degree (`_splits`), CP method, micro-batch size and AC mode at TP `tp` x
    PP `pp` x FSDP (the rest); none when the degrees or the batch do not divide."""
    if cluster.world % (tp * pp):
        return []
    out = []
    for dp, cp, ep in _splits(work, cluster, tp, cluster.world // (tp * pp), across):
        if work.global_batch % dp:
            continue  # every data-parallel rank needs whole sequences
        local = work.global_batch // dp
        out += [
            _evaluate(work, cluster, Layout(tp, pp, dp, 3, ac, ep, cp, method), local, micro)
            for micro in _micro_batches(work, local, pp)
            for ac in ("none", "full")
            for method in _cp_methods(work.model_args, tp, cp)
        ]
    return out


def _cp_methods(model_args, tp: int, cp: int) -> list[str]:
    """The CP methods a layout can use: the all-gather always (without CP it names none), and
    Ulysses where each TP x CP rank gets whole heads (`ulysses_problems`' rule)."""
    if cp == 1:
        return ["allgather"]
    kv = model_args.n_kv_heads // tp
    heads_split = model_args.n_heads % (tp * cp) == 0 and (kv % cp == 0 or cp % kv == 0)
    return ["allgather", "ulysses"] if heads_split else ["allgather"]


def advise(work: Workload, cluster: Cluster) -> Advice:
    """Searches TP (within a node) x PP x CP (both methods where Ulysses' head split holds) x
    FSDP (the rest) and both AC modes at a fixed global
    batch of `work.global_batch` sequences (each data-parallel rank runs global_batch / dp of
    them in micro-batches of up to `work.micro_batch`; PP uses micro-batches of 1). Proposes
    the fitting layout with the fewest pipeline stages and the fastest modelled step. PP is
    used only when nothing fits without it (bubble, schedule constraints). With experts, EP
    groups (ep x tp ranks) stay inside a node unless nothing fits at that PP degree: the
    all-to-alls are per layer and on the critical path, so they need NVLink; so do CP groups
    (cp x tp ranks: their K/V all-gathers or all-to-alls are per layer and exposed too)."""
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
        context_parallel_method=lay.cp_method,
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
