"""Muon for the hidden matrices, AdamW for everything else, in one `torch.optim.Optimizer`.

The Muon update of a weight matrix W with gradient G (`torch.optim.Muon`'s, which one process
reproduces exactly): the momentum buffer B <- lerp(B, G, 1 - mu); the update U = lerp(G, B, mu)
with Nesterov, else B; O = NS(U), the quintic Newton-Schulz iteration that orthogonalises U
(in bfloat16 by default, as torch's); W <- W (1 - lr wd) - lr s(W) O, with s the update scale:
"original" sqrt(max(1, rows / cols)) (Keller Jordan's), "match_rms_adamw" 0.2 sqrt(max(rows,
cols)) (Moonshot's, so that AdamW's learning rate and weight decay carry over).

Which parameters get Muon: every matrix (2 or more dims) outside the family's `embeddings` and
`head` modules (tied copies count as the weight they copy). Embeddings, the output layer,
norms, biases, sinks and other vectors get AdamW, as in the references. A stacked expert weight
[E, a, b] is E matrices, each orthogonalised on its own; a family whose stored weight holds
several logical matrices says so in `ModelSpec.matrix_layouts` (gpt-oss's gate_up_proj holds
gate and up columns interleaved) and each is orthogonalised alone. Every other weight is one
matrix as stored; fused projections (DeepSeek-V3's wkv_a) are one matrix there too,
as in Moonlight and torchtitan.

NS needs the whole matrix, which sharded layouts split over ranks; `training.muon_exchange`
moves each matrix to one owner rank and back (see there). Momentum, weight decay and the
update itself are element-wise and stay on each rank's shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from models.contract import MatrixLayout
from training.muon_exchange import build_shard_groups, exchange_and_orthogonalise

NS_EPS = 1e-7  # torch.optim.Muon's: the norm clamp before the iteration


def newton_schulz(u: torch.Tensor, coefficients, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of `u` [..., m, n] (a stack: each matrix alone), in
    `dtype`; for one matrix in bfloat16 it is torch's, operation for operation."""
    a, b, c = coefficients
    x = u.to(dtype)
    wide = x.size(-2) > x.size(-1)
    if wide:
        x = x.mT
    if x.ndim == 2:
        x = x / x.norm().clamp(min=NS_EPS)
        mm = torch.addmm
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
        mm = torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if wide else x


def orthogonalise(u: torch.Tensor, layout: MatrixLayout, coefficients, steps, dtype):
    """NS of each logical matrix of the full update `u` (any leading stack dims)."""
    lead = u.shape[:-2]
    if u.ndim > 3:
        u = u.reshape(-1, *u.shape[-2:])
    k = layout.interleaved
    if k > 1:  # [..., a, b*k] -> k matrices [..., a, b] -> back
        split = u.unflatten(-1, (-1, k)).movedim(-1, 0)
        out = newton_schulz(split.reshape(-1, *split.shape[-2:]), coefficients, steps, dtype)
        out = out.reshape(split.shape).movedim(0, -1).flatten(-2)
    else:
        out = newton_schulz(u, coefficients, steps, dtype)
    return out.reshape(*lead, *out.shape[-2:])


def update_scale(shape: torch.Size, layout: MatrixLayout, rule: str) -> float:
    """The learning-rate factor of one logical matrix of a stored weight of `shape`."""
    rows, cols = shape[-2], shape[-1] // layout.interleaved
    if layout.rows_last:
        rows, cols = cols, rows
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))  # "original"


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class MuonOptions:
    """The `[optimizer]` muon_* keys, resolved (`ns_dtype` None: the parameter's dtype)."""

    momentum: float
    nesterov: bool
    ns_steps: int
    ns_coefficients: tuple[float, float, float]
    update_scale: str
    ns_dtype: torch.dtype | None


class MuonWithAdamW(torch.optim.Optimizer):
    """Param groups with `muon: True` get Muon (`MuonOptions`), the others AdamW with the
    group's lr, betas, eps and weight decay (torch's functional AdamW: the same state and
    kernels as torch.optim.AdamW). One optimizer, so checkpoints, the LR schedule, clipping and
    hooks see one object. Muon groups carry their own "lr" (`MuonOptions.lr`). `layouts`:
    id(parameter) -> MatrixLayout for the weights not stored as plain matrices."""

    def __init__(self, groups, muon: MuonOptions, *, lr, betas, eps, fused, foreach, layouts):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0, "muon": False}
        super().__init__(groups, defaults)
        self.muon, self.fused, self.foreach = muon, fused, foreach
        self.layouts = layouts
        params = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        self.shard_groups = build_shard_groups(params)
        self.exchanged = {id(p) for sg in self.shard_groups for p in sg.params}

    def describe(self) -> str:
        """One line for the log: what gets Muon, AdamW, and the exchange."""
        muon = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        rest = [p for g in self.param_groups if not g["muon"] for p in g["params"]]
        sizes = sorted({sg.size for sg in self.shard_groups})
        received = [g.received() for g in self.shard_groups]
        ours, everywhere = sum(r[0] for r in received), sum(r[1] for r in received)
        return (
            f"Muon on {len(muon)} matrices ({sum(p.numel() for p in muon):,} elements), AdamW "
            f"on {len(rest)} tensors ({sum(p.numel() for p in rest):,}); "
            f"{len(self.exchanged)} sharded matrices go to owners in "
            f"{len(self.shard_groups)} groups of {sizes or '-'} ranks, receiving {ours:,} "
            f"elements a step here (gathering every matrix: {everywhere:,})"
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step()
        for group in self.param_groups:
            if not group["muon"]:
                self._adamw_step(group)
        return loss

    def _ns(self, update: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        m = self.muon
        layout = self.layouts.get(id(param), MatrixLayout())
        return orthogonalise(update, layout, m.ns_coefficients, m.ns_steps, self._ns_dtype(param))

    def _ns_dtype(self, param: torch.Tensor) -> torch.dtype:
        return self.muon.ns_dtype or param.dtype

    def _muon_step(self) -> None:
        m, updates, where = self.muon, {}, {}
        for group in self.param_groups:
            if not group["muon"]:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                g, b = local(p.grad), local(buf)
                b.lerp_(g, 1 - m.momentum)
                u = g.lerp(b, m.momentum) if m.nesterov else b
                updates[id(p)] = u if id(p) in self.exchanged else self._ns(u, p)
                where[id(p)] = (p, group)
        for sg in self.shard_groups:  # every rank of a group, every step, in one order
            missing = [p.shape for p in sg.params if id(p) not in updates]
            if missing:  # a rank without the gradient would leave its group's exchange
                raise RuntimeError(f"Muon: sharded parameters of shapes {missing} have no grad")
            ready = [updates[id(p)].to(self._ns_dtype(p)) for p in sg.params]
            for p, o in zip(sg.params, exchange_and_orthogonalise(sg, ready, self._ns)):
                updates[id(p)] = o
        for key, o in updates.items():
            p, group = where[key]
            scale = update_scale(p.shape, self.layouts.get(id(p), MatrixLayout()), m.update_scale)
            w = local(p)
            w.mul_(1 - group["lr"] * group["weight_decay"])
            w.add_(o, alpha=-group["lr"] * scale)

    def _adamw_step(self, group: dict) -> None:
        """torch's functional AdamW (what torch.optim.AdamW.step calls) over the group, with
        the state torch.optim.AdamW would create."""
        from torch.optim.adamw import adamw
        from torch.optim.optimizer import _get_scalar_dtype

        params, grads, avgs, sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                dev = p.device if self.fused else "cpu"
                state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=self.fused),
                                            device=dev)  # fmt: skip
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            avgs.append(state["exp_avg"])
            sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(params, grads, avgs, sqs, [], steps, foreach=self.foreach, fused=self.fused,
              amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)  # fmt: skip
