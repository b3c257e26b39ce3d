"""Hugging Face files and DCP checkpoints, for any model family: safetensors (one file or
sharded) in and out, a checkpoint's full model weights read into one process, a model-only
checkpoint written, and the family and arguments a checkpoint records. How a family's names
and config.json map to Hugging Face's is the family's `hf` adapter (`models.HFAdapter`)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint.state import single_process
from checkpoint.storage import CheckpointError, commit, prepare_tmp, read_layout, step_dir


# ------------------------------------------------------------------------------ safetensors
def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards named by the index file."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(
            f"{folder} has neither model.safetensors nor model.safetensors.index.json"
        )
    out = {}
    for name in files:
        out.update(load_file(str(folder / name)))
    return out


def write_hf_weights(
    tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int = 5 * 2**30
) -> list[str]:
    """Writes one file, or shards plus `model.safetensors.index.json` past max_shard_bytes."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += n
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


# ------------------------------------------------------------------------------------ DCP
def read_dcp_model(path: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) `model.*` tensors of a checkpoint, in one process on CPU."""
    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    sd = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in md.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    if not sd:
        raise CheckpointError(f"{path} holds no model weights")
    with single_process():
        dcp.load(sd, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return {k[len("model.") :]: v for k, v in sd.items()}


def model_from_layout(path: Path):
    """(the model family's ModelSpec, its args) recorded in a checkpoint's layout.json."""
    from models import get_model_spec

    model = read_layout(path).get("model", {})
    if not model.get("args"):
        raise CheckpointError(f"{path}/layout.json does not record the model arguments")
    try:
        spec = get_model_spec(model.get("name", "llama3"))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    args_cls = type(next(iter(spec.flavors.values())))
    return spec, args_cls(**model["args"])


def hf_adapter(spec):
    """The family's Hugging Face adapter, or one error saying the family has none."""
    if spec.hf is None:
        raise CheckpointError(
            f"model family '{spec.name}' has no Hugging Face adapter (ModelSpec.hf): its "
            "checkpoints cannot be converted. Families with one: "
            + ", ".join(n for n, s in _families().items() if s.hf is not None)
        )
    return spec.hf


def _families():
    from models import all_model_specs

    return all_model_specs()


def write_dcp_model(sd: dict[str, torch.Tensor], out_folder: Path, layout: dict) -> Path:
    """A model-only `step-0` checkpoint in `out_folder`, committed like a training save."""
    final = step_dir(Path(out_folder), 0)
    tmp = prepare_tmp(final)
    with single_process():
        dcp.save({"model": sd}, checkpoint_id=str(tmp), no_dist=True)
    commit(
        tmp,
        final,
        {
            "step": 0,
            "contents": ["model"],
            "world_size": 1,
            "parallelism": {},
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "torch_version": torch.__version__,
            **layout,
        },
    )
    return final


def total_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def human_bytes(n: int) -> str:
    if n <= 0:
        return "0 B"
    k = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**k:.2f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][k]}"
