"""Mixture-of-experts layers the MoE families share, in plain PyTorch (no parallelism, no trainer
imports): the router and dispatch (`MoE`), the standard SwiGLU experts (`GroupedExperts`), the
grouped matmul, and the shape fields an MoE family's args add (`MoEShape`).

`MoE` is a linear router (optionally with a bias, gpt-oss) over E experts, token-choice top-k on
the softmax scores, the k weights renormalised to sum to one (`norm_topk_prob`; the softmax over
the k largest logits, as gpt-oss computes it, is the same weights); or DeepSeek-V3's: sigmoid
scores, the choice limited to each token's best expert groups, the weights scaled, and shared
experts every token passes through (`MoEShape`'s fields). It is **dropless**: every
token reaches its k experts, there is no capacity factor, so the result of a token never
depends on which other tokens share its batch or its rank. The experts module is the family's:
it takes the (token, choice) rows sorted by expert with their counts (`forward(x, counts,
weights=None)`), its weights stacked on a leading expert dimension.

Load balancing, all optional:
- the auxiliary loss (Switch Transformer): coeff x E x sum_i f_i P_i, f_i the share of the
  tokens that chose expert i (the f_i add up to k, as transformers counts it for Qwen3-MoE, so
  Qwen3's coefficient means the same here), P_i the mean router probability of expert i (with
  sigmoid scores, each token's scores divided by their sum, as DeepSeek-V3's balance loss). Both are
  taken over the *global* micro-batch (every data-parallel rank's tokens of one micro-step),
  through `MoE.reduce_stats`, which a parallelism sets to a sum over the data-parallel ranks
  (identity on one process). Each rank back-propagates its own tokens' share of it, so the
  gradients summed over the ranks are those of one process holding the whole micro-batch;
- the auxiliary-loss-free bias (DeepSeek-V3): a per-expert `expert_bias` added to the scores
  for choosing the top-k only (the weights stay the softmax scores), moved after every
  optimizer step by `update_rate` toward balance, from the step's global expert counts;
- the router z-loss (ST-MoE): coeff x logsumexp(router logits)^2 per token.
The auxiliary terms are sums over tokens scaled by `MoE.loss_scale`, the factor the trainer
divides its token-loss sum by, and reach the gradients through `AuxLossGrad` (the block's
output carries their gradient; the value is logged, not added to the language-model loss).

Expert compute (`GroupedExperts`): one grouped matmul over experts (`torch._grouped_mm` where
the device and dtype have it, else one padded batched matmul), or a per-expert loop, the
reference the tests compare against. A parallelism may hand the experts' forward its tokens
already exchanged and the weights of the experts it holds (`weights=`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.blocks import FeedForward
from models.numerics import at_least_float32


@dataclass
class MoEShape:
    """The fields `MoE` reads, which an MoE family's args dataclass inherits (put it before the
    decoder shape in the bases, so its `shape_problems` runs too)."""

    n_experts: int = 128
    top_k: int = 8
    moe_ffn_dim: int = 768  # each expert's hidden size
    norm_topk_prob: bool = True
    moe_aux_loss_coeff: float = 0.001  # Qwen3-MoE's router_aux_loss_coef; 0 = off
    moe_bias_update_rate: float = 0.0  # aux-loss-free balancing step (DeepSeek-V3: 1e-3); 0 = off
    moe_z_loss_coeff: float = 0.0  # router z-loss (ST-MoE: 1e-3); 0 = off
    moe_grouped_mm: bool = True  # False: the per-expert loop (the reference)
    # DeepSeek-V3's routing: sigmoid scores (each expert's own, not a softmax over experts),
    # the choice limited to the `moe_topk_groups` of `moe_n_groups` expert groups whose two
    # best (biased) scores add up highest, the k weights times `moe_route_scale`; and
    # `n_shared_experts` experts that every token passes through (one SwiGLU of
    # n_shared_experts x moe_ffn_dim hidden units, its output added unweighted)
    moe_score_func: str = "softmax"  # "softmax" | "sigmoid"
    moe_n_groups: int = 1
    moe_topk_groups: int = 1
    moe_route_scale: float = 1.0
    n_shared_experts: int = 0

    def shape_problems(self) -> list[str]:
        problems = super().shape_problems()
        if not 1 <= self.top_k <= self.n_experts:
            problems.append(f"top_k = {self.top_k} must be in 1..n_experts = {self.n_experts}")
        if self.moe_score_func not in ("softmax", "sigmoid"):
            problems.append(f"moe_score_func = '{self.moe_score_func}': softmax or sigmoid")
        groups, kept = self.moe_n_groups, self.moe_topk_groups
        if groups < 1 or self.n_experts % groups or not 1 <= kept <= groups:
            problems.append(f"moe_n_groups = {groups} must divide n_experts = {self.n_experts} "
                            f"and moe_topk_groups = {kept} be in 1..moe_n_groups")  # fmt: skip
        elif groups > 1 and kept * (self.n_experts // groups) < self.top_k:
            problems.append(f"the {kept} kept groups hold fewer than top_k = {self.top_k} experts")
        return problems

    @property
    def active_experts_share(self) -> float:
        return self.top_k / self.n_experts


class AuxLossGrad(torch.autograd.Function):
    """Returns `x` unchanged; in backward, also gives `aux` (a scalar already scaled as the
    loss it belongs to) the gradient 1, so an auxiliary loss computed inside the model trains
    without being added to the loss the trainer sees (Megatron's MoEAuxLossAutoScaler). Works
    on every pipeline stage: each stage's backward starts from its own output."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def _aligned(t: torch.Tensor) -> bool:
    """`torch._grouped_mm` needs every stride but the unit one to be a multiple of 16 bytes."""
    return all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [N, K] (rows sorted by expert, counts[e] rows for expert e) @ w[e] [K, M] -> [N, M]."""
    if torch.is_autocast_enabled(x.device.type):  # autocast does not cover the grouped matmul
        x = x.to(torch.get_autocast_dtype(x.device.type))
    w = w.to(x.dtype)
    grouped = getattr(torch, "_grouped_mm", None)
    # CPU: float32/bfloat16/float16 (not float64); CUDA: bfloat16 only
    cpu_ok = x.device.type == "cpu" and x.dtype != torch.float64
    usable = cpu_ok or x.dtype == torch.bfloat16
    if grouped is not None and usable and _aligned(x) and _aligned(w):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return grouped(x, w, offs=offs)
    # One batched matmul over experts, each padded to the largest expert's rows.
    n_experts = w.shape[0]
    expert = torch.repeat_interleave(torch.arange(n_experts, device=x.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(x.shape[0], device=x.device) - starts[expert]
    cap = int(counts.max()) if x.shape[0] else 0
    padded = x.new_zeros(n_experts, cap, x.shape[1])
    padded[expert, pos] = x
    return torch.bmm(padded, w)[expert, pos]


def expert_swiglu(x, counts, w1, w2, w3, grouped: bool = True) -> torch.Tensor:
    """SwiGLU of each expert over its rows of `x`: w2(silu(w1 x) * w3 x), the weights [E, out,
    in] as Hugging Face's per-expert linears. `grouped` False: one matmul per expert."""
    if grouped:
        h = F.silu(grouped_matmul(x, w1.mT, counts)) * grouped_matmul(x, w3.mT, counts)
        return grouped_matmul(h, w2.mT, counts)
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start : start + n]
        out.append(F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e]))
        start += n
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as three [E, out, in] tensors."""

    def __init__(self, n_experts: int, dim: int, hidden: int, grouped: bool = True):
        super().__init__()
        self.grouped = grouped
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # gate_proj
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # down_proj
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # up_proj

    def forward(self, x: torch.Tensor, counts: torch.Tensor, weights=None) -> torch.Tensor:
        """x [N, dim], rows sorted by expert with `counts` rows each -> [N, dim]. `weights`:
        (w1, w2, w3) of the experts `counts` covers, when a parallelism holds only some."""
        w1, w2, w3 = weights if weights is not None else (self.w1, self.w2, self.w3)
        return expert_swiglu(x, counts, w1, w2, w3, self.grouped)


def _in_backward() -> bool:
    """True while autograd runs a backward pass (activation checkpointing recomputes forward
    there): the routing statistics are then not counted a second time."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """Router + experts, dropless token-choice top-k (see the module doc): `args` a `MoEShape`
    with `dim`; `experts` the family's experts module (default: `GroupedExperts`);
    `router_bias`: a learned bias on the router logits (gpt-oss)."""

    def __init__(self, args, experts: nn.Module | None = None, router_bias: bool = False):
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.top_k
        self.norm_topk_prob = args.norm_topk_prob
        self.aux_coeff, self.z_coeff = args.moe_aux_loss_coeff, args.moe_z_loss_coeff
        self.bias_rate = args.moe_bias_update_rate
        self.score_func, self.route_scale = args.moe_score_func, args.moe_route_scale
        self.n_groups, self.topk_groups = args.moe_n_groups, args.moe_topk_groups
        self.router = nn.Linear(args.dim, args.n_experts, bias=router_bias)
        if experts is None:
            experts = GroupedExperts(
                args.n_experts, args.dim, args.moe_ffn_dim, args.moe_grouped_mm
            )
        self.experts = experts
        if args.n_shared_experts:
            hidden = args.n_shared_experts * args.moe_ffn_dim
            self.shared_experts = FeedForward(args.dim, hidden)
        # Aux-loss-free balancing bias (a checkpointed buffer, not a parameter: no gradient).
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=True)
        # Since the last optimizer step: global tokens per expert and the aux loss's value.
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.reduce_stats = None  # set by a parallelism: sums a float64 vector over DP ranks
        self.counting = True  # False: a forward whose tokens are not training tokens
        self.loss_scale = 1.0  # set by the trainer: 1 / its token-loss normaliser

    def init_buffers(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """The balancing bias and the step's statistics, zero, in the model's dtype (at least
        float32; float64 in a float64 model), after materialisation."""
        self.expert_bias = torch.zeros(self.n_experts, device=device, dtype=dtype)
        self.tokens_per_expert = torch.zeros(self.n_experts, device=device, dtype=dtype)
        self.aux_loss_sum = torch.zeros((), device=device, dtype=dtype)

    def route(self, x: torch.Tensor):
        """(router logits fp32 (fp64 in a float64 model) [T, E], scores [T, E], chosen experts
        [T, k], weights [T, k])."""
        logits = at_least_float32(self.router(x))
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        chosen = torch.topk(self.limited_to_groups(scores + self.expert_bias), self.top_k).indices
        weights = scores.gather(-1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, scores, chosen, weights * self.route_scale

    def limited_to_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """The biased scores [T, E] with the experts outside each token's `topk_groups` best
        groups (a group's worth: the sum of its two best scores) set to -inf."""
        if self.n_groups == 1:
            return biased
        grouped = biased.unflatten(-1, (self.n_groups, -1))  # [T, groups, E / groups]
        worth = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        kept = worth.topk(self.topk_groups, dim=-1).indices
        hidden = torch.ones_like(worth, dtype=torch.bool).scatter(-1, kept, False)
        return grouped.masked_fill(hidden[..., None], float("-inf")).flatten(-2)

    def global_stats(self, chosen: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """[2, E] float64: tokens per expert and summed router probabilities over the global
        micro-batch (this rank's when no parallelism set `reduce_stats`)."""
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)
        stats = torch.stack([counts.double(), scores.detach().sum(0).double()])
        return self.reduce_stats(stats) if self.reduce_stats is not None else stats

    def aux_loss(self, logits, scores, stats) -> torch.Tensor:
        """This rank's share of the auxiliary losses (token sums x `loss_scale`); also counts
        the global micro-batch's load-balancing loss for the logs."""
        counts, prob_sums = stats[0], stats[1]
        tokens = counts.sum() / self.top_k  # global tokens of the micro-batch
        f = (counts / tokens).to(scores.dtype)
        aux = logits.new_zeros(())
        if self.aux_coeff > 0:
            aux = aux + self.aux_coeff * self.n_experts * (f * scores.sum(0)).sum()
            if self.counting and not _in_backward():
                global_aux = self.n_experts * (f * (prob_sums / tokens).to(f.dtype)).sum()
                self.aux_loss_sum += self.aux_coeff * global_aux.detach()
        if self.z_coeff > 0:
            aux = aux + self.z_coeff * torch.logsumexp(logits, dim=-1).square().sum()
        return aux * self.loss_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, scores, chosen, weights = self.route(x)
        if self.score_func == "sigmoid":  # the balance statistics read a distribution
            scores = scores / scores.sum(dim=-1, keepdim=True)
        if self.training:
            stats = self.global_stats(chosen, scores)
            if self.counting and not _in_backward():
                self.tokens_per_expert += stats[0].to(self.tokens_per_expert.dtype)
        # Sort the (token, choice) pairs by expert; stable, so the order is the layout's own.
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        y = self.experts(x[order // self.top_k], counts)
        y = y[torch.argsort(order)].view(-1, self.top_k, shape[-1])
        out = (y * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1).view(shape)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x).view(shape)
        if self.training and (self.aux_coeff > 0 or self.z_coeff > 0):
            out = AuxLossGrad.apply(out, self.aux_loss(logits, scores, stats))
        return out


class MoEDecoder:
    """Mixin for a decoder (models/blocks.py) whose blocks hold `MoE` layers: materialising it
    also fills their buffers, in the dtype of its RoPE table (the model's, at least float32).
    Put it before the decoder class in the bases."""

    def init_buffers(self, device: torch.device | str) -> None:
        super().init_buffers(device)  # on `device`: CPU offload leaves buffers on the host
        for module in self.modules():
            if isinstance(module, MoE):
                module.init_buffers(device, self.rope.dtype)
