"""What layout a run really built, read from the built objects (never echoed from the config).

`built_layout` inspects the mesh, the model parts (DTensor placements of the parameters, FSDP
and ZeRO wrappers, activation-checkpoint wrappers, compiled blocks, the pipeline stages'
layers) and the schedule, gathers every rank's view, and returns one JSON-ready dict. The
trainer writes it to `<dump_folder>/layout.json`; the parity tests compare it with the layout
they asked for, so a parallelism that is silently not applied fails them.

Only the model contract's names are used: blocks are the entries of `model.layers`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from metrics.memory_report import param_bytes
from models.init_weights import canonical_name
from parallelisms.context_parallel import CP_CORES
from parallelisms.parallel_dims import ParallelDims

LAYOUT_FILE_NAME = "layout.json"


def _placement_name(placement) -> str:
    dim = getattr(placement, "dim", None)
    return type(placement).__name__ + (f"({dim})" if dim is not None else "")


def _data_parallel(model_parts: list[nn.Module]) -> dict:
    """How gradients are synchronised: FSDP2 (ZeRO-3), `apply_zero` (stages 0-2) or none."""
    for part in model_parts:
        if any(isinstance(m, FSDPModule) for m in part.modules()):
            return {"kind": "fsdp", "zero_stage": 3}
        zero = getattr(part, "_zero", None)
        if zero is not None:
            return {
                "kind": "zero",
                "zero_stage": zero.stage,
                "mesh": list(zero.mesh.mesh_dim_names),
            }
    return {"kind": "none", "zero_stage": None}


def _blocks(part: nn.Module) -> dict[str, nn.Module]:
    layers = getattr(part, "layers", None)
    return dict(layers.items()) if layers is not None else {}


def _compiled(block: nn.Module) -> bool:
    """The block, or a part of it (a family may compile only some), runs a compiled forward."""
    return any(hasattr(m.forward, "_torchdynamo_orig_callable") for m in block.modules())


def _rank_view(model_parts: list[nn.Module], parallel_dims: ParallelDims) -> dict:
    """This rank's part of the record."""
    placements: dict[str, Counter] = {}
    numel = Counter()
    for part in model_parts:
        for raw, p in part.named_parameters():
            kind = (
                "blocks_2d"
                if canonical_name(raw).startswith("layers.") and p.ndim >= 2
                else "other"
            )
            local = p.to_local() if isinstance(p, DTensor) else p
            numel[f"local_{kind}"] += local.numel()
            numel[f"global_{kind}"] += p.numel()  # a DTensor's numel is the full tensor's
            if isinstance(p, DTensor):
                for dim, pl in zip(p.device_mesh.mesh_dim_names, p.placements):
                    placements.setdefault(dim, Counter())[_placement_name(pl)] += 1
            else:
                placements.setdefault("none", Counter())["plain"] += 1
    blocks = {key: block for part in model_parts for key, block in _blocks(part).items()}
    ac_op = [
        key
        for key, block in blocks.items()
        if isinstance(block, CheckpointWrapper)
        and "context_fn" in getattr(block.checkpoint_fn, "keywords", {})
    ]
    mesh = parallel_dims.mesh
    coords = {n: mesh[n].get_local_rank() for n in (mesh.mesh_dim_names or ())} if mesh else {}
    return {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "coordinates": coords,
        "stages": len(model_parts),
        "layers": sorted(blocks, key=lambda k: (len(k), k)),
        "numel": dict(numel),
        "param_bytes": param_bytes(model_parts),
        "placements": {dim: dict(c) for dim, c in sorted(placements.items())},
        "ac_blocks": sorted(k for k, b in blocks.items() if isinstance(b, CheckpointWrapper)),
        "ac_selective_op_blocks": sorted(ac_op),
        "compiled_blocks": sorted(k for k, b in blocks.items() if _compiled(b)),
        "context_parallel_blocks": sorted(k for k, b in blocks.items() if _context_parallel(b)),
        "context_parallel_method": sorted(
            {
                n
                for b in blocks.values()
                for m in b.modules()
                for n, c in CP_CORES.items()
                if type(m) is c
            }
        ),  # fmt: skip
        "data_parallel": _data_parallel(model_parts),
    }


def _context_parallel(block: nn.Module) -> bool:
    """The block's attention gathers the sequence over "cp"."""
    return any(isinstance(m, tuple(CP_CORES.values())) for m in block.modules())


def built_layout(model_parts: list[nn.Module], parallel_dims: ParallelDims, schedule) -> dict:
    """The layout every rank built (a collective on all ranks when distributed)."""
    mine = _rank_view(model_parts, parallel_dims)
    ranks = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    mesh = parallel_dims.mesh
    dims = dict(zip(mesh.mesh_dim_names or (), mesh.shape)) if mesh is not None else {}
    return {
        "world_size": len(ranks),
        "mesh": {n: s for n, s in dims.items() if s > 1},
        "pipeline_schedule": type(schedule).__name__ if schedule is not None else None,
        "ranks": ranks,
    }


def write_layout(dump_folder: str, layout: dict) -> Path:
    path = Path(dump_folder) / LAYOUT_FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(layout, indent=1) + "\n")
    return path


def summarize(layout: dict) -> str:
    """One log line: mesh, data parallelism, schedule, per-rank stages/AC/compile counts."""
    r0 = layout["ranks"][0]
    dp = r0["data_parallel"]
    parts = [
        f"mesh {layout['mesh'] or '{}'}",
        f"data parallel {dp['kind']}"
        + (f" (ZeRO-{dp['zero_stage']})" if dp["zero_stage"] is not None else ""),
        f"pipeline {layout['pipeline_schedule']} ({r0['stages']} stage(s) on rank 0)"
        if layout["pipeline_schedule"]
        else "no pipeline",
        f"AC blocks on rank 0: {len(r0['ac_blocks'])}",
        f"compiled blocks on rank 0: {len(r0['compiled_blocks'])}",
        f"context-parallel blocks on rank 0: {len(r0['context_parallel_blocks'])}",
    ]
    return "built layout: " + ", ".join(parts)
