"""Whole matrices for Muon's Newton-Schulz on sharded layouts: owner-computes.

A weight that FSDP, HSDP, TP, ZeRO-1/2 or EP splits over ranks is a DTensor; the ranks that
hold its pieces are its *shard group*: the ranks along the mesh dims its placements shard
(replicas along the other dims, HSDP's replicate dim or a TP-replicated weight's, form groups
of their own and compute the same result). Per shard group, each matrix gets one owner,
balanced by Newton-Schulz cost (greedy, largest first). Each optimizer step one all_to_all
sends every rank's pieces to their owners, each owner orthogonalises its whole matrices, and a
second all_to_all returns each rank its pieces of the results.

Per rank, with W ranks in the group and S bytes of matrices in it, that receives
2 (W - 1) S / W^2 and computes NS for S / W (`ShardGroup.received` counts it; the run logs
it); gathering every matrix on every rank would receive (W - 1) S / W and compute NS for all
of S (W = 2 moves the same bytes and halves the NS work; W = 8 moves a quarter). Tensors go
in the NS dtype (bfloat16 by default): the iteration's first step casts to it anyway. Where a placement splits only the leading dims of a
stacked weight (EP's experts), every rank already holds whole matrices and nothing moves.

Where each rank's piece sits in the whole matrix comes from DTensor's own layout function
(`compute_local_shape_and_global_offset`, what DCP saves shards with), exchanged once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard


@dataclass
class Piece:
    """One rank's piece of a matrix: its box in the whole tensor."""

    shape: tuple[int, ...]
    offset: tuple[int, ...]

    def box(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape))

    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass
class ShardGroup:
    """The matrices one set of ranks shares, with each one's owner and every rank's piece."""

    group: dist.ProcessGroup
    me: int  # this rank's index in the group
    size: int
    params: list[torch.Tensor] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    pieces: list[list[Piece]] = field(default_factory=list)  # [matrix][group rank]

    def received(self) -> tuple[int, int]:
        """Elements this rank receives per step: (owner-computes, gathering every matrix)."""
        ours = sum(
            sum(pc.numel() for r, pc in enumerate(pieces) if r != self.me)
            if o == self.me else pieces[self.me].numel()
            for o, pieces in zip(self.owners, self.pieces)
        )  # fmt: skip
        everywhere = sum(p.numel() - pieces[self.me].numel()
                         for p, pieces in zip(self.params, self.pieces))  # fmt: skip
        return ours, everywhere


def _sharded_dims(p: DTensor) -> list[int]:
    """The mesh dims (of size > 1) that shard `p`, if one of them splits a matrix dim (the last
    two); else none: each rank holds whole matrices (EP's experts split along dim 0)."""
    dims = [i for i, pl in enumerate(p.placements)
            if isinstance(pl, (Shard, _StridedShard)) and p.device_mesh.size(i) > 1]  # fmt: skip
    splits_matrix = any(p.placements[i].dim % p.ndim >= p.ndim - 2 for i in dims)
    return dims if splits_matrix else []


def _group_ranks(p: DTensor, dims: list[int]) -> tuple[int, ...]:
    """The global ranks of `p`'s shard group (the ranks along `dims`, this rank's elsewhere)."""
    coord = p.device_mesh.get_coordinate()
    index = tuple(slice(None) if i in dims else c for i, c in enumerate(coord))
    return tuple(sorted(p.device_mesh.mesh[index].flatten().tolist()))


def needs_exchange(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and bool(_sharded_dims(p))


def _process_groups(keys: set[tuple[int, ...]]) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A new process group per shard group spanning several mesh dims (`keys`: their ranks),
    of any rank: every rank learns every rank's keys and creates them all in one order
    (`new_group` is collective over the world). One mesh dim's groups are the mesh's own."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(keys))
    union = sorted({tuple(k) for ks in gathered for k in ks})
    return {k: dist.new_group(list(k)) for k in union}


def _nscost(shape: torch.Size) -> int:
    m, n = shape[-2], shape[-1]
    return shape.numel() * min(m, n)


def build_shard_groups(params: list[torch.Tensor]) -> list[ShardGroup]:
    """The shard groups of the Muon parameters that need an exchange (collective over the world:
    every rank calls it, in the same order, with its own parameters)."""
    by_key: dict[tuple[int, ...], list[DTensor]] = {}
    pgs = {}
    for p in params:
        if needs_exchange(p):
            dims = _sharded_dims(p)
            key = _group_ranks(p, dims)
            by_key.setdefault(key, []).append(p)
            if len(dims) == 1:
                pgs.setdefault(key, p.device_mesh.get_group(dims[0]))
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return []
    pgs = {**_process_groups(set(by_key) - set(pgs)), **pgs}
    groups = []
    for key, members in sorted(by_key.items()):
        pg = pgs[key]
        g = ShardGroup(pg, dist.get_rank(pg), len(key), params=members)
        mine = []
        for p in members:
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                                  p.placements)  # fmt: skip
            assert tuple(shape) == tuple(p.to_local().shape), (p.shape, p.placements, shape)
            mine.append(Piece(tuple(shape), tuple(offset)))
        every: list = [None] * g.size
        dist.all_gather_object(every, mine, group=pg)
        g.pieces = [[every[r][i] for r in range(g.size)] for i in range(len(members))]
        load = [0] * g.size
        for i in sorted(range(len(members)), key=lambda i: -_nscost(members[i].shape)):
            owner = min(range(g.size), key=lambda r: (load[r], r))
            load[owner] += _nscost(members[i].shape)
            g.owners.append((i, owner))
        g.owners = [o for _, o in sorted(g.owners)]
        groups.append(g)
    return groups


def _all_to_all(chunks: list[list[torch.Tensor]], out_sizes: list[int], group, like):
    """Sends chunks[r] (concatenated) to group rank r; returns what each rank sent here."""
    send = [torch.cat(c) if c else like.new_empty(0) for c in chunks]
    out = like.new_empty(sum(out_sizes))
    dist.all_to_all_single(out, torch.cat(send), out_sizes, [t.numel() for t in send],
                           group=group)  # fmt: skip
    return list(out.split(out_sizes))


def exchange_and_orthogonalise(g: ShardGroup, updates: list[torch.Tensor], orthogonalise):
    """`updates`: this rank's local pieces of g.params' updates (in the NS dtype); returns this
    rank's pieces of `orthogonalise(whole update, param)` for each, the owners computing it."""
    like = updates[0]
    owned = [i for i, o in enumerate(g.owners) if o == g.me]
    sizes_in = [sum(g.pieces[i][r].numel() for i in owned) for r in range(g.size)]
    chunks = [[updates[i].reshape(-1) for i, o in enumerate(g.owners) if o == r]
              for r in range(g.size)]  # fmt: skip
    received = _all_to_all(chunks, sizes_in, g.group, like)
    starts = [0] * g.size
    back: list[list[torch.Tensor]] = [[] for _ in range(g.size)]
    for i in owned:
        whole = like.new_empty(g.params[i].shape)
        for r in range(g.size):
            piece, n = g.pieces[i][r], g.pieces[i][r].numel()
            whole[piece.box()] = received[r][starts[r] : starts[r] + n].view(piece.shape)
            starts[r] += n
        result = orthogonalise(whole, g.params[i]).to(like.dtype)
        for r in range(g.size):
            back[r].append(result[g.pieces[i][r].box()].reshape(-1))
    sizes_out = [sum(g.pieces[i][g.me].numel() for i, o in enumerate(g.owners) if o == r)
                 for r in range(g.size)]  # fmt: skip
    returned = _all_to_all(back, sizes_out, g.group, like)
    out, starts = [], [0] * g.size
    for i, o in enumerate(g.owners):
        piece = g.pieces[i][g.me]
        out.append(returned[o][starts[o] : starts[o] + piece.numel()].view(piece.shape))
        starts[o] += piece.numel()
    return out
