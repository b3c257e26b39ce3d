"""Parallel degrees, their validation, and the one DeviceMesh every parallelism works on.

Mesh dimensions, outermost first: "pp", "dp_replicate", "dp_shard", "cp", "tp" (size-1
dimensions are left out). Flattened views the rest of the system uses:
  "dp"           = dp_replicate x dp_shard: data loading ranks (each reads other sequences)
  "dp_shard_cp"  = dp_shard x cp: where FSDP shards the weights (CP ranks hold the same weights
                   and other tokens of the same sequences, so their gradients are averaged too)
  "dp_cp"        = dp_replicate x dp_shard x cp: every rank holding other tokens
  "dp_shard_tp"  = dp_shard x tp: where parameters are sharded (FSDP over TP-sharded params)

Context parallelism (cp > 1) splits every sequence over the "cp" ranks of one data-parallel
replica (see parallelisms/context_parallel.py). It sits inside the data dimensions and outside
"tp": TP's per-layer collectives are the more frequent, so TP keeps the nearest ranks.

Expert parallelism (ep > 1) draws its ranks from the data-parallel shard and CP ranks, the
innermost ep of dp_shard x cp (torchtitan's rule). Without CP, "dp_shard" is built as
("dp_shard_mod_ep", "ep") and flattened back to "dp_shard"; with CP (ep a multiple of cp) it
is built as ("dp_shard_mod_ep", "dp_shard_in_ep") and "ep" is the flattened ("dp_shard_in_ep",
"cp"): every CP rank of a sequence is in one EP group. Either way every dense parallelism sees
the same "dp_shard" (and "dp", "dp_shard_cp", "dp_shard_tp") as without EP. "ep" is the
inner part: the EP ranks are neighbours (one node at ep x tp <= 8 GPUs per node), where
the all-to-alls, the heaviest traffic of an MoE step, run on the fastest links. Why the data
and CP ranks: EP ranks must hold different tokens (each sends its own to the experts' owners),
which data-parallel and CP ranks do and TP ranks (which share their tokens) do not. The
experts are then sharded by FSDP over "dp_shard_mod_ep" = dp_shard x cp / ep (kept in the
mesh even at size 1, so the experts always have that mesh; so is "dp_shard_in_ep"), the dense
weights over all of "dp_shard_cp".
Likewise "dp_shard" stays at size 1 next to "dp_replicate" (HSDP over replicas only, without
CP): FSDP2 needs its 2-D mesh.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from job_config.problems import Problems

logger = logging.getLogger("meshtrain")


# Flattened dimensions and the mesh dimensions they join (those present, in this order).
# "ep" is a mesh dimension without CP and joins ("dp_shard_in_ep", "cp") with it.
_SHARD = ("dp_shard_mod_ep", "dp_shard_in_ep", "ep", "dp_shard")
_FLATTENED = {
    "dp_shard": _SHARD[:3],
    "dp": ("dp_replicate", *_SHARD),
    "dp_shard_cp": (*_SHARD, "cp"),
    "dp_cp": ("dp_replicate", *_SHARD, "cp"),
    "dp_shard_tp": (*_SHARD, "tp"),
    "ep": ("dp_shard_in_ep", "cp"),
}


def _flattened(names) -> dict[str, tuple[str, ...]]:
    """The flattened dimensions of a mesh with these dimensions: name -> its present parts
    ("ep" only where it is flattened: EP x CP)."""
    out = {flat: tuple(n for n in parts if n in names) for flat, parts in _FLATTENED.items()}
    if "dp_shard_in_ep" not in names:
        del out["ep"]
    return out


class ParallelismError(ValueError):
    """An impossible layout, reported before any process-group work."""


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    zero_stage: int = 3
    ep: int = 1
    cp: int = 1
    mesh: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def from_config(
        cls,
        *,
        world_size: int,
        dp_replicate: int,
        dp_shard: int,
        tp: int,
        pp: int,
        zero_stage: int = 3,
        ep: int = 1,
        cp: int = 1,
    ) -> ParallelDims:
        """Resolves dp_shard = -1 and checks that the degrees multiply to the world size;
        raises every problem found at once."""
        problems = Problems(ParallelismError)
        fixed = dp_replicate * cp * tp * pp
        if dp_shard == -1:
            if world_size % fixed:
                problems.add(
                    f"World size {world_size} is not divisible by pipeline_parallel_degree "
                    f"({pp}) x data_parallel_replicate_degree ({dp_replicate}) x "
                    f"context_parallel_degree ({cp}) x tensor_parallel_degree ({tp}) = {fixed}, so "
                    "data_parallel_shard_degree = -1 cannot fill the rest. Change the degrees "
                    "or the number of ranks."
                )
            else:
                dp_shard = world_size // fixed
        product = fixed * dp_shard
        if dp_shard != -1 and product != world_size:
            problems.add(
                f"Parallel degrees multiply to {product}, not the world size {world_size}: "
                f"pipeline ({pp}) x data_parallel_replicate ({dp_replicate}) x "
                f"data_parallel_shard ({dp_shard}) x context ({cp}) x tensor ({tp}) = {product}. "
                "Make the "
                f"product {world_size}, or set data_parallel_shard_degree = -1."
            )
        for problem in cls.combination_problems(dp_replicate, dp_shard, cp, ep, zero_stage):
            problems.add(problem)
        problems.raise_any()
        return cls(dp_replicate, dp_shard, tp, pp, world_size, zero_stage, ep, cp)

    @staticmethod
    def combination_problems(
        dp_replicate: int, dp_shard: int, cp: int, ep: int, zero_stage: int
    ) -> list[str]:
        """Which dimensions combine: HSDP is ZeRO-3 only, and the EP ranks come from the
        data-parallel shard x CP ranks (dp_shard = -1: not resolved yet, not checked)."""
        out = []
        if zero_stage < 3 and dp_replicate > 1:
            out.append(
                f"parallelism.zero_stage = {zero_stage} with data_parallel_replicate_degree = "
                f"{dp_replicate}: HSDP (replicate x shard) is ZeRO-3 only. Use "
                "data_parallel_shard_degree for ZeRO-0/1/2, or zero_stage = 3."
            )
        if ep > 1 and cp > 1 and ep % cp:
            out.append(
                f"parallelism.expert_parallel_degree = {ep} with context_parallel_degree = "
                f"{cp}: the EP ranks are drawn from the data-parallel shard x CP ranks with all "
                "CP ranks of a sequence in one EP group, so the EP degree must be a multiple of "
                "the CP degree. Choose such an EP degree."
            )
        elif ep > 1 and dp_shard != -1 and (dp_shard * cp) % ep:
            out.append(
                f"parallelism.expert_parallel_degree = {ep} must divide the data-parallel shard "
                f"degree {dp_shard} x context_parallel_degree {cp} (EP ranks are drawn from the "
                "FSDP shard and CP ranks). Choose an EP degree that divides it, or more ranks."
            )
        return out

    @classmethod
    def from_parallelism(cls, parallelism, world_size: int) -> ParallelDims:
        """`from_config` for a config's `[parallelism]` section."""
        p = parallelism
        return cls.from_config(
            world_size=world_size,
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            zero_stage=p.zero_stage,
            ep=p.expert_parallel_degree,
            cp=p.context_parallel_degree,
        )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """The ranks holding other tokens of the same weights (data-parallel x CP): the degree
        over which gradients are reduced and FSDP shards."""
        return self.dp * self.cp

    @property
    def data_parallel_enabled(self) -> bool:
        """Whether the weights have copies on ranks that see other tokens (data-parallel or
        CP ranks), so `apply_data_parallel` shards them and averages their gradients."""
        return self.dp_cp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.data_parallel_enabled and self.zero_stage == 3

    def batch_problems(self, global_batch: int, local_batch: int) -> list[str]:
        """The global batch must be a whole number of local batches on every data-parallel
        rank (-1: exactly one)."""
        per_micro = local_batch * self.dp
        if global_batch == -1 or global_batch % per_micro == 0:
            return []
        return [
            f"training.global_batch_size = {global_batch} must be a multiple of "
            f"local_batch_size ({local_batch}) x data-parallel degree ({self.dp}) = "
            f"{per_micro}; the quotient is the number of gradient-accumulation steps."
        ]

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """One `init_device_mesh` call for all named dimensions, plus the flattened views."""
        shard = [("dp_shard", self.dp_shard)]
        keep = set()
        if self.ep_enabled and self.cp_enabled:  # "ep" = ("dp_shard_in_ep", "cp"), flattened
            in_ep = self.ep // self.cp
            shard = [("dp_shard_mod_ep", self.dp_shard // in_ep), ("dp_shard_in_ep", in_ep)]
            keep = {"dp_shard_mod_ep", "dp_shard_in_ep"}
        elif self.ep_enabled:
            shard = [("dp_shard_mod_ep", self.dp_shard // self.ep), ("ep", self.ep)]
            keep = {"dp_shard_mod_ep"}
        dims = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            *shard,
            ("cp", self.cp),
            ("tp", self.tp),
        ]
        if self.dp_replicate > 1 and self.cp == 1:
            # HSDP with one shard rank is still FSDP2 on the 2-D (dp_replicate, dp_shard) mesh
            keep.add("dp_shard")
        names = tuple(n for n, d in dims if d > 1 or n in keep) or ("dp_shard",)
        shape = tuple(d for n, d in dims if d > 1 or n in keep) or (1,)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for flat, present in _flattened(names).items():
            if len(present) > 1:
                mesh[present]._flatten(flat)
        self.mesh = mesh
        return mesh

    def dim_name(self, name: str) -> str | None:
        """The name a (possibly flattened) dimension has in the mesh: itself, or its one
        present part (e.g. "dp_shard_cp" is "dp_shard" without CP); None when it has size 1."""
        assert self.mesh is not None, "call build_mesh() first"
        present = self.mesh.mesh_dim_names or ()
        if name in present:
            return name
        parts = _flattened(present).get(name, ())
        if len(parts) == 1:
            return parts[0]
        return name if parts else None

    def group_names(self) -> dict[str, str]:
        """This rank's process group along every dimension of the mesh, flattened ones
        included: dimension -> the name the group is registered under in this process."""
        assert self.mesh is not None, "call build_mesh() first"
        groups = {}
        for name in (*(self.mesh.mesh_dim_names or ()), *_FLATTENED):
            sub = self.dim(name)
            if sub is not None:
                groups[name] = sub.get_group().group_name
        return groups

    def dim(self, name: str) -> DeviceMesh | None:
        """The sub-mesh of a (possibly flattened) dimension, or None when it has size 1."""
        resolved = self.dim_name(name)
        return None if resolved is None else self.mesh[resolved]

    def coordinate(self, name: str) -> tuple[int, int]:
        """(rank, size) of this process along a dimension; (0, 1) when the dimension is absent."""
        sub = self.dim(name)
        if sub is None:
            return 0, 1
        return sub.get_local_rank(), sub.size()

    def describe(self) -> str:
        parts = [
            f"{n}={getattr(self, n)}" for n in ("pp", "dp_replicate", "dp_shard", "tp", "ep", "cp")
        ]
        return f"world={self.world_size} " + " ".join(parts) + f" zero_stage={self.zero_stage}"


def log_mesh(parallel_dims: ParallelDims) -> None:
    """Logs the degrees once and this rank's coordinates along each dimension."""
    mesh = parallel_dims.mesh
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    coords = {}
    if mesh is not None and mesh.mesh_dim_names:
        coords = {n: mesh[n].get_local_rank() for n in mesh.mesh_dim_names}
    logger.info("mesh: %s | rank %d coordinates %s", parallel_dims.describe(), rank, coords)
