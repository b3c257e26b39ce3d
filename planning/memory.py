"""Memory formulas: activations per layer and per rank, and the ZeRO paper's bytes per parameter.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", eqs. 1-2): sbh(34 + 5as/h) bytes per layer, with tensor/sequence-parallel
and recompute variants; the totals use the model family's own count of what one block saves
(`ModelSpec.block_activation_bytes`). Under context parallelism (cp ranks per sequence) a rank
counts its s/cp tokens and adds what attention over the gathered keys keeps; the block masks
of the layers' attention specs come once per micro-batch (`attention_bytes`). Arithmetic: no
model or process group is needed (`planning.simulate` reads the rest from the parallelized
model, and the layers' `AttentionSpec`s from the model on the meta device).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.attention import BLOCK, AttentionBatch, AttentionSpec
from parallelisms.parallel_dims import ParallelDims

GIB = float(1 << 30)


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


@dataclass(frozen=True)
class AttentionBytes:
    """What attention adds on one rank beyond the family's count at its tokens (bytes). The
    backends keep no [queries, keys] tensor: SDPA's fused kernels, FlexAttention and the CPU
    block-sparse kernel save q, k, v, the output and a float32 log-sum-exp per query and head
    (in the family's count), K/V at their own head count.

    kv:        per layer, saved: CP's gathered K and V at the K/V heads' size, [b, n_kv_heads/t,
               s, head_dim] each, of which the family's count at s/cp tokens already holds the
               local 1/cp.
    masks:     per micro-batch: the block masks (`models.attention.attention_batch`), one per
               distinct spec that needs one, shared by its layers: FlexAttention's BlockMask
               holds 8 int32 tensors, [b, 1, s/cp/128 (, s/128)] and their transposes.
    transient: one layer's backward at a time: the gradients of the gathered K and V (K/V
               heads) before their reduce-scatter.
    """

    kv: float = 0.0
    masks: float = 0.0
    transient: float = 0.0

    @property
    def per_layer(self) -> float:
        return self.kv


def layer_attention_specs(model: nn.Module) -> list[AttentionSpec]:
    """Each attention layer's `AttentionSpec` in layer order: the `spec` of every module that
    has one (the shared `AttentionCore`, or the context-parallel core that replaced it). The
    whole model on the meta device gives every layer's (FLOPs per token, block masks)."""
    return [m.spec for m in model.modules() if isinstance(getattr(m, "spec", None), AttentionSpec)]


def block_mask_bytes(q_len: int, k_len: int, b: int) -> float:
    """Bytes of one `BlockMask` over `q_len` queries and `k_len` keys (`b` sequences): its
    number-of-blocks vectors and block-index matrices, partial and full, for the key blocks of
    each query block and (built by `BlockMask.from_kv_blocks`) the query blocks of each key
    block, int32."""
    size = math.gcd(BLOCK, q_len, k_len)
    qb, kb = q_len // size, k_len // size
    return 4.0 * b * (2 * (qb + kb) + 4 * qb * kb)


def masked_specs(
    specs: Sequence[AttentionSpec], document_mask: bool, cp: int
) -> list[AttentionSpec]:
    """The specs, one per mask key, that get a block mask per micro-batch (the rule of
    `models.attention.attention_batch`: none when every layer is plain causal over its own
    sequence; else each spec that is not, or whose layers mask documents or see CP's keys)."""
    meta = torch.empty(0, device="meta")
    batch = AttentionBatch(meta, meta, meta if document_mask else None, keys_given=cp > 1)
    if not document_mask and cp <= 1 and all(s.fused_causal for s in specs):
        return []
    keyed = {s.key: s for s in specs if batch.needs_mask(s)}
    return list(keyed.values())


def attention_bytes(
    model_args,
    s: int,
    b: int,
    tp: int,
    cp: int,
    elem: int = 2,
    document_mask: bool = False,
    specs: Sequence[AttentionSpec] = (AttentionSpec(),),
    method: str = "allgather",
) -> AttentionBytes:
    """`AttentionBytes` of `s`-token sequences (`b` per micro-batch) split over `cp` ranks,
    TP degree `tp`, `elem`-byte activations, for a model whose layers compute `specs` (their
    distinct `AttentionSpec`s; default plain causal); reads n_heads, n_kv_heads and head_dim.
    Plain causal attention without CP or document masking adds nothing. `method` "ulysses":
    no gathered K/V (the head shards of q, k, v and the output are as large as the rank's own,
    which the family's count holds); each layer keeps the whole sequence's block mask, and one
    layer's backward holds the all-to-all buffers of q, k, v and the output."""
    local = s // cp
    masks = len(masked_specs(specs, document_mask, cp)) * block_mask_bytes(local, s, b)
    if cp <= 1:
        return AttentionBytes(masks=masks)
    kv_dim = model_args.n_kv_heads * model_args.head_dim / tp
    if method == "ulysses":
        q_dim = model_args.n_heads * model_args.head_dim / tp
        buffers = 2.0 * b * local * (q_dim + kv_dim) * elem
        return AttentionBytes(kv=block_mask_bytes(s, s, b), masks=masks, transient=buffers)
    return AttentionBytes(
        kv=2.0 * b * (s - local) * kv_dim * elem,
        masks=masks,
        transient=2.0 * b * s * kv_dim * elem,
    )


@dataclass
class Activations:
    """One rank's activation estimate, term by term (bytes): `kept` layers at `per_layer`
    and `checkpointed` ones at `per_checkpointed`, for each of `microbatches` in flight, plus
    the one layer full AC recomputes in backward and the logits of the last stage. Under CP
    (`cp` > 1) `s` is the whole sequence and the rank holds s/cp of it; `attention` is what CP's
    gathered keys and the block masks add (the K/V in `per_layer` and `recompute` already; the
    masks once per micro-batch in flight and one layer's transient on top)."""

    s: int
    b: int
    h: int
    a: int
    tp: int
    korthikanti: float  # Korthikanti's count of one layer at s/cp tokens, for reference
    block: float  # the model family's count of one layer at s/cp tokens (no CP terms)
    kept: int
    per_layer: float
    checkpointed: int
    per_checkpointed: float
    microbatches: int
    recompute: float
    logits: float
    cp: int = 1
    attention: AttentionBytes = AttentionBytes()

    @property
    def total(self) -> int:
        layers = self.microbatches * (
            self.kept * self.per_layer + self.checkpointed * self.per_checkpointed
        )
        cp_extra = self.microbatches * self.attention.masks + self.attention.transient
        return int(layers + self.recompute + self.logits + cp_extra)

    def describe(self) -> str:
        """The terms in words and GiB, as the per-rank table's notes print them."""
        kept, full = self.kept, self.checkpointed
        return (
            f"s={self.s}"
            + (f"/cp {self.cp} = {self.s // self.cp}" if self.cp > 1 else "")
            + f" b={self.b} h={self.h} a={self.a} t={self.tp} (Korthikanti "
            f"{self.korthikanti / GIB:.3f} GiB/layer, the family's block count "
            f"{self.block / GIB:.3f}"
            + (self._describe_attention() if self.attention.kv or self.attention.masks else "")
            + "): "
            + (f"{kept} layers x {self.per_layer / GIB:.3f} GiB" if kept else "")
            + (" + " if kept and full else "")
            + (f"{full} checkpointed x {self.per_checkpointed / GIB:.3f} GiB" if full else "")
            + (f", x {self.microbatches} microbatches in flight" if self.microbatches > 1 else "")
            + (f", + 1 layer recomputed {self.recompute / GIB:.3f} GiB" if self.recompute else "")
            + (f", logits {self.logits / GIB:.2f} GiB" if self.logits else "")
        )

    def _describe_attention(self) -> str:
        c = self.attention
        return (
            (f"; per layer + gathered K/V {c.kv / GIB:.3f}" if c.kv else "")
            + (f"; + block masks {c.masks / GIB:.4f} per micro-batch" if c.masks else "")
            + (f"; + one layer's gathered K/V gradients {c.transient / GIB:.3f}" if c.kv else "")
        )


def _microbatches(cfg, dims: ParallelDims, pp_rank: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches in flight) on pipeline rank `pp_rank`."""
    t, p = cfg.training, cfg.parallelism
    if dims.pp <= 1:
        return t.local_batch_size, 1
    b = p.pipeline_parallel_microbatch_size
    n_micro = max(1, t.local_batch_size // b)
    return b, in_flight_microbatches(p.pipeline_parallel_schedule, dims.pp, pp_rank, n_micro)


def _checkpointing(ac, layers: int) -> tuple[int, str]:
    """(layers fully checkpointed, Korthikanti recompute mode of the others) under `ac`:
    selective AC with a number N checkpoints every N-th layer whole; with `op` it saves the
    outputs of the matmuls and attention of every layer and recomputes the rest (no attention
    scores, were a backend to keep them)."""
    numbered = ac.mode == "selective" and ac.selective_ac_option.isdigit()
    if numbered:
        full_layers = layers // int(ac.selective_ac_option)
    else:
        full_layers = layers if ac.mode == "full" else 0
    rec = "selective" if ac.mode == "selective" and not numbered else "none"
    return full_layers, rec


def rank_activations(
    cfg,
    model_args,
    dims: ParallelDims,
    pp_rank: int,
    layers: int,
    has_output: bool,
    block_bytes: Callable,
    scores_stored: bool = False,
    specs: Sequence[AttentionSpec] = (AttentionSpec(),),
) -> Activations:
    """Activation estimate for one rank holding `layers` blocks (16-bit activations; attention
    keeps no scores unless `scores_stored`): `block_bytes(args, seq_len, batch, tp)` is the
    family's count of what one block saves (`ModelSpec.block_activation_bytes`), taken at the
    rank's seq_len / cp tokens, in every AC mode (op-level selective AC saves a part of it: the
    family's count is its upper bound); CP's gathered K/V and the block masks of the model's
    distinct attention `specs` come on top (`attention_bytes`)."""
    s, h, a, tp, cp = cfg.training.seq_len, model_args.dim, model_args.n_heads, dims.tp, dims.cp
    local = s // cp  # tokens of each sequence on this rank
    b, micro = _microbatches(cfg, dims, pp_rank)
    full_layers, rec = _checkpointing(cfg.activation_checkpoint, layers)
    korth = korthikanti_layer_bytes(local, b, h, a, tp, recompute=rec, scores_stored=scores_stored)
    block = block_bytes(model_args, local, b, tp)
    docs = cfg.training.document_mask
    method = cfg.parallelism.context_parallel_method
    attention = attention_bytes(model_args, s, b, tp, cp, document_mask=docs, specs=specs,
                                method=method)  # fmt: skip
    whole = block + attention.per_layer
    if scores_stored and rec != "selective":  # Korthikanti's 5as/h: [local queries x s keys]
        whole += 5.0 * a * b * local * s / tp
    logits = 0.0
    if has_output:  # bf16 logits + fp32 copy for the cross-entropy, vocab-sharded under TP
        logits = micro * local * b * model_args.vocab_size / tp * (2 + 4)
    return Activations(
        s,
        b,
        h,
        a,
        tp,
        korthikanti=korth,
        block=block,
        kept=layers - full_layers,
        per_layer=whole,
        checkpointed=full_layers,
        per_checkpointed=korthikanti_layer_bytes(local, b, h, a, tp, recompute="full"),
        microbatches=micro,
        recompute=whole if full_layers else 0.0,  # backward recomputes one layer at a time
        logits=logits,
        cp=cp,
        attention=attention,
    )


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
