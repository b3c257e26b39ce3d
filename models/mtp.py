"""Multi-token prediction (DeepSeek-V3, section 2.2), for any decoder family (plain PyTorch, no
parallelism): `depth` modules after the blocks, in the model's `mtp` ModuleDict ("0", "1", ...).
Module k (1-based) predicts token t+1+k at every position t from two inputs of that position:
the previous depth's hidden state (the main model's final normed one for k = 1) and the
embedding of token t+k. It normalises both (`hnorm`, `enorm`), projects their concatenation,
embedding first, back to the model width (`eh_proj`), runs one block of the family's own kind
and its final norm (`norm`, DeepSeek's `shared_head.norm`); its output is the next depth's
hidden state, and the model's own output head (shared, as DeepSeek trains it) turns it into
logits. Megatron's convention: every depth's hidden state is normed, the main one included.

The labels of every depth come with the micro-batch (`mtp_labels` [batch, seq, depth + 1]: the
model's labels, then the labels `k` positions later, cut from the whole sequence before a
context-parallel split, so the positions past a rank's chunks are there); column k-1 gives the
token ids module k embeds, column k its targets. Each module's loss is the trainer's step loss
(token-loss sum over the step's global token count, `set_loss`), so the losses of all depths
average over the same tokens as the main loss in every layout; their mean times `weight` (the
lambda of the paper) trains the model through `AuxLossGrad` without entering the loss the trainer
sees, and `take_logged_losses` hands the trainer the unweighted mean for its metrics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ATTRIBUTE = "mtp"  # where a model keeps its modules (absent or empty: no multi-token prediction)


class MultiTokenPrediction(nn.Module):
    """One depth: the two norms, the projection, a block of the family's kind, the final norm."""

    def __init__(self, dim: int, norm_eps: float, block: nn.Module):
        super().__init__()
        self.enorm = nn.RMSNorm(dim, eps=norm_eps)  # the embedding of token t+k
        self.hnorm = nn.RMSNorm(dim, eps=norm_eps)  # the previous depth's hidden state
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        # set by the trainer: (logits, labels) -> the token-loss sum over the step's token count
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.weight = 0.0  # this depth's share of the loss weight (lambda / depth)
        self.loss_sum: torch.Tensor | None = None  # unweighted, since the trainer last read it

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope, batch) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], -1))
        return self.norm(self.block(x, rope, batch))


def modules(model: nn.Module) -> list[MultiTokenPrediction]:
    """A model's (or pipeline stage's) multi-token-prediction modules, in depth order."""
    found = getattr(model, ATTRIBUTE, None)
    return list(found.values()) if found is not None else []


def blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Their blocks by key ("mtp.0", ...): what runs like a block of `model.layers`."""
    found = getattr(model, ATTRIBUTE, None)
    return {f"{ATTRIBUTE}.{k}": m.block for k, m in found.items()} if found is not None else {}


def embedded_inputs(embeddings: nn.Module, tokens: torch.Tensor, mtp_labels: torch.Tensor):
    """The token embeddings of `tokens` and of each depth's input ids (`mtp_labels` columns
    0..depth-1; an ignored label, negative, embeds token 0: its targets are ignored too), in
    one lookup: (hidden [batch, seq, dim], [embedded ids of depth 1, 2, ...])."""
    depth = mtp_labels.shape[-1] - 1
    ids = [tokens, *mtp_labels[..., :depth].clamp(min=0).unbind(-1)]
    return embeddings(torch.cat(ids, 0)).chunk(depth + 1, 0)


def logits_with_losses(
    model: nn.Module, hidden: torch.Tensor, embedded: list, rope, batch, mtp_labels: torch.Tensor
) -> torch.Tensor:
    """The main logits from `hidden` (the final normed hidden state), with every depth's loss
    attached for backward: each depth's hidden state from the previous one, all turned into
    logits by one call of the model's `output` (concatenated on the batch dimension), each
    depth's loss the trainer's step loss of its logits and targets (column k of
    `mtp_labels`)."""
    from models.moe import AuxLossGrad  # models.moe builds on models.blocks, which imports this

    depths = modules(model)
    states = [hidden]
    for module, emb in zip(depths, embedded, strict=True):
        states.append(module(states[-1], emb, rope, batch))
    logits = model.output(torch.cat(states, 0)).chunk(len(states), 0)
    aux = None
    for k, module in enumerate(depths, start=1):
        if module.loss_fn is None:
            raise RuntimeError("multi-token prediction: the trainer sets each module's loss_fn")
        loss = module.loss_fn(logits[k], mtp_labels[..., k])
        module.loss_sum = loss.detach() + (0 if module.loss_sum is None else module.loss_sum)
        aux = loss * module.weight if aux is None else aux + loss * module.weight
    return AuxLossGrad.apply(logits[0], aux)


def set_loss(model_parts: list[nn.Module], loss_fn, weight: float) -> None:
    """Every module's loss: `loss_fn` (the trainer's step loss), the mean over the depths
    times `weight` trained."""
    found = [m for part in model_parts for m in modules(part)]
    for module in found:
        module.loss_fn, module.weight = loss_fn, weight / len(found)


def take_logged_losses(model_parts: list[nn.Module]) -> torch.Tensor | None:
    """The mean over depths of the losses since the last call (each depth's summed over its
    micro-batches, as the step's loss is), and starts again; None without modules (or before
    their first training forward)."""
    found = [m for part in model_parts for m in modules(part) if m.loss_sum is not None]
    if not found:
        return None
    total = torch.stack([m.loss_sum for m in found]).mean()
    for module in found:
        module.loss_sum = None
    return total
