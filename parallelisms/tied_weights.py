"""Tied weights across pipeline stages: a model that shares one parameter between two modules
(`tied_parameters()`: tied embeddings, the token embedding matrix used again as the output
projection) keeps, once a pipeline split puts the two uses on two stages, two equal copies,
as Megatron does:

- both start equal: the copy is initialised as the parameter itself (`init_weights` reads it
  under the parameter's own name);
- after each step's backward (and its data-parallel reduction) the two gradients are summed
  and both copies get the sum, which is the gradient of the shared parameter: between the
  first and the last pipeline rank of each (DP, TP, CP) column, one exchange of the local
  shards over the pipeline group; on one rank (V schedules hold the first and the last stage
  together) in place;
- the gradient norm counts the parameter once (the copies are clipped, not counted);
- the optimizer treats the copy as the parameter (its weight-decay group) and, given equal
  values and gradients, updates both alike, so they stay equal bit for bit.

Checkpoints need nothing more: a tied model's state dict already holds both names (model and
optimizer state), so each stage saves and loads its own and every layout reads every other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from models.init_weights import canonical_name


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    """This rank's piece of `p`'s gradient, laid out as the parameter (under TP the embedding's
    gradient can come back replicated while the weight and the output's copy are sharded)."""
    g = p.grad
    if not isinstance(g, DTensor):
        return g
    if tuple(g.placements) != tuple(p.placements):
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return g.to_local()


@dataclass
class TiedWeights:
    """This rank's ends of the model's tied pairs once split into stages, by name ({copy:
    parameter}); `peer`: the rank of `group` holding the other ends (None: both are here).
    The parameters are looked up in `parts` on first use, after materialisation."""

    parts: list[nn.Module]
    names: dict[str, str]
    group: dist.ProcessGroup | None = None
    peer: int | None = None
    _pairs: list | None = field(default=None, init=False, repr=False)

    @property
    def pairs(self) -> list[tuple[nn.Parameter | None, nn.Parameter | None]]:
        """(parameter, copy) for each tied pair held apart, either None where another rank
        holds that end."""
        if self._pairs is None:
            named = _named(self.parts)
            ends = [(named.get(src), named.get(cp)) for cp, src in self.names.items()]
            self._pairs = [(s, c) for s, c in ends if s is not c]  # apart, at least one here
        return self._pairs

    @property
    def copies(self) -> list[nn.Parameter]:
        """The copies: clipped with the rest, left out of the gradient norm."""
        return [c for _, c in self.pairs if c is not None]

    def sum_gradients(self) -> None:
        """Both ends' gradients become their sum (call once per step, after the reduction)."""
        ops, received = [], []
        for source, copy in self.pairs:
            if source is not None and copy is not None:
                mine, other = _local_grad(source), _local_grad(copy)
                total = mine + other
                mine.copy_(total)
                other.copy_(total)
                continue
            mine = _local_grad(source if source is not None else copy)
            other = torch.empty_like(mine)
            peer = dist.get_global_rank(self.group, self.peer)
            ops += [
                dist.P2POp(dist.isend, mine.contiguous(), peer, self.group),
                dist.P2POp(dist.irecv, other, peer, self.group),
            ]
            received.append((mine, other))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        for mine, other in received:
            mine.add_(other)  # a + b on one end, b + a on the other: the same float sum


def _named(parts: list[nn.Module]) -> dict[str, nn.Parameter]:
    return {canonical_name(n): p for part in parts for n, p in part.named_parameters()}


def tied_weights(
    parts: list[nn.Module], pp_group, pp_rank: int, first_owner: int, last_owner: int
) -> TiedWeights | None:
    """What keeps the tied pairs of this rank's pipeline `parts` equal, None for a model that
    ties nothing or a rank with neither end: the parameter lives with the first stage
    (pipeline rank `first_owner`), its copy with the last (`last_owner`), as the model's
    embeddings and head do."""
    names = parts[0].tied_parameters() if hasattr(parts[0], "tied_parameters") else {}
    if not names or pp_rank not in (first_owner, last_owner):
        return None
    peer = last_owner if pp_rank == first_owner else first_owner
    return TiedWeights(parts, names, pp_group, None if first_owner == last_owner else peer)
