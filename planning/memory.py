"""Memory formulas: activations per layer and per rank, and the ZeRO paper's bytes per parameter.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", eqs. 1-2): sbh(34 + 5as/h) bytes per layer, with tensor/sequence-parallel
and recompute variants; the totals use the model family's own count of what one block saves
(`ModelSpec.block_activation_bytes`). Under context parallelism (cp ranks per sequence) a rank
counts its s/cp tokens and adds what attention over the gathered keys keeps, and the
explicit mask CP and document masking pass to attention (`attention_bytes`). Pure arithmetic: nothing here needs a model or a process group
(`planning.simulate` reads the rest from the parallelized model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    """What attention adds on one rank beyond the family's causal count at its tokens (bytes):
    CP's gathered keys and, under document masking, the explicit mask (zeros without).

    kv:         per layer, saved: SDPA keeps the gathered K and V repeated to the query heads,
                [b, n_heads/t, s, head_dim] each, of which the family's count at s/cp tokens
                already holds the local 1/cp.
    mask:       per layer, saved: SDPA's compute-dtype copy of the [b, 1, s/cp, s] mask
                (measured on CPU: a boolean mask is saved converted, 2 B per element).
    mask_input: per micro-batch: the boolean mask itself (1 B per element), one for all layers.
    transient:  one layer's backward at a time: the gradients of the repeated gathered K and V
                and of the gathered K and V (kv heads) before their reduce-scatter.
    """

    kv: float = 0.0
    mask: float = 0.0
    mask_input: float = 0.0
    transient: float = 0.0

    @property
    def per_layer(self) -> float:
        return self.kv + self.mask


def attention_bytes(
    model_args, s: int, b: int, tp: int, cp: int, elem: int = 2, document_mask: bool = False
) -> AttentionBytes:
    """`AttentionBytes` of `s`-token sequences (`b` per micro-batch) split over `cp`
    ranks, TP degree `tp`, `elem`-byte activations; reads n_heads, n_kv_heads and head_dim.
    The mask exists with document masking only: plain CP attends chunk by chunk with torch's
    lower-right causal bias, which CUDA's fused kernels apply without a mask (on CPU, SDPA
    builds one per chunk; not counted). Without CP only a document mask adds anything."""
    local = s // cp
    mask = float(b) * local * s if document_mask else 0.0
    if cp <= 1:
        return AttentionBytes(mask=mask * elem, mask_input=mask)
    q_dim = model_args.n_heads * model_args.head_dim / tp
    kv_dim = model_args.n_kv_heads * model_args.head_dim / tp
    return AttentionBytes(
        kv=2.0 * b * (s - local) * q_dim * elem,
        mask=mask * elem,
        mask_input=mask,
        transient=2.0 * b * s * (q_dim + kv_dim) * elem,
    )


@dataclass
class Activations:
    """One rank's activation estimate, term by term (bytes): `kept` layers at `per_layer`
    and `checkpointed` ones at `per_checkpointed`, for each of `microbatches` in flight, plus
    the one layer full AC recomputes in backward and the logits of the last stage. Under CP
    (`cp` > 1) `s` is the whole sequence and the rank holds s/cp of it; `attention` is what CP's
    gathered keys and an explicit mask add (in `per_layer` and `recompute` already; the mask
    once per micro-batch in flight and one layer's transient on top)."""

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
        cp_extra = self.microbatches * self.attention.mask_input + self.attention.transient
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
            + (self._describe_attention() if self.attention.mask else "")
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
            "; per layer"
            + (f" + gathered K/V {c.kv / GIB:.3f}" if c.kv else "")
            + f" + mask copy {c.mask / GIB:.3f}; + boolean mask {c.mask_input / GIB:.3f} per "
            "micro-batch"
            + (f", + one layer's gathered K/V gradients {c.transient / GIB:.3f}" if c.kv else "")
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
    selective AC with a number N checkpoints every N-th layer whole, with `op` it recomputes
    the attention scores of every layer."""
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
) -> Activations:
    """Activation estimate for one rank holding `layers` blocks (16-bit activations; fused
    attention unless `scores_stored`): `block_bytes(args, seq_len, batch, tp)` is the family's
    count of what one block saves (`ModelSpec.block_activation_bytes`), taken at the rank's
    seq_len / cp tokens; CP's gathered keys and the mask come on top (`attention_bytes`)."""
    s, h, a, tp, cp = cfg.training.seq_len, model_args.dim, model_args.n_heads, dims.tp, dims.cp
    local = s // cp  # tokens of each sequence on this rank
    b, micro = _microbatches(cfg, dims, pp_rank)
    full_layers, rec = _checkpointing(cfg.activation_checkpoint, layers)
    korth = korthikanti_layer_bytes(local, b, h, a, tp, recompute=rec, scores_stored=scores_stored)
    block = block_bytes(model_args, local, b, tp)
    mask = cfg.training.document_mask
    attention = attention_bytes(model_args, s, b, tp, cp, document_mask=mask)
    whole = block + attention.per_layer
    if scores_stored:  # Korthikanti's 5as/h term: [local queries x s keys] per head
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
        per_layer=korth + attention.per_layer if rec == "selective" else whole,
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
