"""Writing Hugging Face folders without holding a whole model: a live model's weights from any
layout (`save_hf`, one parameter gathered at a time) and a DCP checkpoint's (`stream_dcp_to_hf`,
one tensor read at a time), through a safetensors writer that takes one tensor at a time
(`SafetensorsWriter`). Where each tensor goes is the family's per-tensor description
(`checkpoint.hf.tensor_map`)."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint.hf import hf_adapter, hf_layout, tensor_map, to_hf_tensors
from checkpoint.state import gather_objects, single_process
from checkpoint.storage import CheckpointError

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_hf(
    msd: dict,
    final: Path,
    spec,
    args,
    dtype: torch.dtype,
    *,
    group=None,
    tokenizer_path: str = "",
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """A live model's state dict (full tensors or DTensors in any layout; every rank of
    `group` calls this) -> a Hugging Face folder `final`: config.json, safetensors shards with
    an index, the tokenizer's files. One tensor at a time is gathered (`full_tensor`, on the
    ranks that hold it) and written at once by the lowest rank holding it, into files of its
    own of at most max_shard_bytes (`SafetensorsWriter`); so a rank holds at most one gathered
    tensor.
    Rank 0 then names the files model-0000i-of-0000N, writes the index and commits the folder
    (a .tmp folder renamed)."""
    import torch.distributed as dist

    where = tensor_map(spec, args)
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    rank = dist.get_rank(group) if distributed else 0
    names = sorted(n for n in msd if where(n).names)

    writer: dict[str, int] = {}
    for r, held in enumerate(gather_objects(names, group)):
        for n in held:
            writer.setdefault(n, r)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    gather_objects(None, group)  # the folder exists before anyone writes
    plan, file_of = _plan_files(
        msd, [n for n in names if writer[n] == rank], where, dtype, rank, max_shard_bytes
    )
    _write_gathered(
        msd, names, [writer[n] == rank for n in names], where, dtype, tmp, plan, file_of
    )
    files = {f: {k: s for k, (s, _) in layout.items()} for f, layout in plan.items()}
    everyone = gather_objects(files, group)
    if rank == 0:
        _commit(
            tmp,
            final,
            everyone,
            hf_adapter(spec).config_from_args(args, dtype),
            dtype,
            tokenizer_path,
        )
    gather_objects(None, group)  # committed before anyone goes on
    return final


def _write_gathered(msd, names, writes, where, dtype, tmp: Path, plan, file_of) -> None:
    """Each parameter gathered in turn on every rank holding it (a collective for them); the
    ones this rank `writes` converted to Hugging Face tensors and written into its files."""
    from torch.distributed.tensor import DTensor

    out = None
    try:
        for n, mine in zip(names, writes):
            t = msd[n]
            full = t.full_tensor() if isinstance(t, DTensor) else t  # every rank holding it
            if not mine:
                continue
            if out is None or out.path.name != file_of[n]:
                if out is not None:
                    out.__exit__(None, None, None)
                out = SafetensorsWriter(tmp / file_of[n], plan[file_of[n]])
            for k, v in to_hf_tensors(where(n), full.detach().to("cpu", dtype)).items():
                out.write(k, v)
            del full
    finally:
        if out is not None:
            out.__exit__(None, None, None)


def _plan_files(msd, mine, where, dtype, rank, max_shard_bytes):
    """This rank's output files, planned from the global shapes: ({file: {HF name: (shape,
    dtype)}}, {our name: its file}), a file closed past max_shard_bytes."""
    plan: dict[str, dict] = {}
    file_of: dict[str, str] = {}
    size = 0
    for n in mine:
        layout = hf_layout(where(n), tuple(msd[n].shape), dtype)
        nbytes = sum(math.prod(s) * dtype.itemsize for s, _ in layout.values())
        if not plan or (size and size + nbytes > max_shard_bytes):
            plan[f"part-{rank:05d}-{len(plan):05d}.safetensors"] = {}
            size = 0
        fname = next(reversed(plan))
        plan[fname].update(layout)
        file_of[n], size = fname, size + nbytes
    return plan, file_of


def _commit(tmp: Path, final: Path, everyone: list, config: dict, dtype, tokenizer_path: str):
    """Rank 0: every rank's files named model-0000i-of-0000N, the index, config.json and the
    tokenizer's Hugging Face files written, then the .tmp folder renamed into place."""
    parts = [f for per_rank in everyone for f in per_rank.items()]
    weight_map, total = {}, 0
    for i, (fname, tensors) in enumerate(parts):
        new = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        (tmp / fname).rename(tmp / new)
        weight_map.update({k: new for k in tensors})
        total += sum(math.prod(s) for s in tensors.values()) * dtype.itemsize
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    beside = Path(tokenizer_path).parent if tokenizer_path else None
    for name in HF_TOKENIZER_FILES if beside else ():
        if (beside / name).is_file():
            shutil.copy2(beside / name, tmp / name)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def stream_dcp_to_hf(
    path: Path, spec, args, output: Path, dtype=None, max_shard_bytes: int = 5 * 2**30
) -> tuple[list[str], dict[str, tuple], torch.dtype]:
    """A checkpoint's model -> Hugging Face safetensors in `output`, one tensor in memory at a
    time: each output file's header is planned from the DCP metadata (a tensor larger than
    max_shard_bytes gets a file of its own), then our tensors are read from DCP one by one and
    written. Returns (file names, {HF name: shape}, the dtype written)."""
    where = tensor_map(spec, args)
    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    ours = {k[len("model.") :]: m for k, m in md.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}  # fmt: skip
    if not ours:
        raise CheckpointError(f"{path} holds no model weights")
    absent = [n for n in ours if not where(n).names]
    groups = _file_groups(ours, [n for n in ours if n not in absent], dtype, max_shard_bytes)
    if absent:
        nonzero = [n for n, t in _read_dcp(path, absent, ours).items() if t.any()]
        if nonzero:
            warnings.warn(
                f"{', '.join(nonzero)} {'is' if len(nonzero) == 1 else 'are'} non-zero but "
                "Hugging Face's model has no such tensor: the export leaves them out",
                stacklevel=2,
            )
    output.mkdir(parents=True, exist_ok=True)
    names, weight_map, shapes, total, out_dtype = [], {}, {}, 0, None
    for i, group in enumerate(groups):
        fname = (
            "model.safetensors"
            if len(groups) == 1
            else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        layout = {}  # the file's HF tensors, known from the DCP metadata before any is read
        for n in group:
            layout.update(
                hf_layout(where(n), tuple(ours[n].size), dtype or ours[n].properties.dtype)
            )
        with SafetensorsWriter(output / fname, layout) as f:
            for n in group:  # one of our tensors in memory at a time
                t = _read_dcp(path, [n], ours)[n]
                for k, v in to_hf_tensors(where(n), t.to(dtype) if dtype else t).items():
                    f.write(k, v)
                del t
        names.append(fname)
        for k, (shape, dt) in layout.items():
            weight_map[k], shapes[k] = fname, shape
            total += math.prod(shape) * dt.itemsize
            out_dtype = out_dtype or dt
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names, shapes, out_dtype


def _file_groups(ours: dict, names: list[str], dtype, max_shard_bytes: int) -> list[list[str]]:
    """`names` in output files of at most max_shard_bytes (a larger tensor alone in its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = math.prod(ours[n].size) * (dtype or ours[n].properties.dtype).itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    return groups


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32"}  # fmt: skip


class SafetensorsWriter:
    """A safetensors file written tensor by tensor: the header (every tensor's name, dtype,
    shape and byte range) first, then each tensor's bytes as it comes, in the header's order.
    safetensors' own `save_file` takes the whole dict and serialises the file in memory before
    writing it (twice the file at peak); the format is a little-endian u64 header length, the
    JSON header and the raw bytes, so writing it directly keeps one tensor in memory."""

    def __init__(self, path: Path, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        self.path, self.order, self.layout = Path(path), list(layout), layout
        header, start = {"__metadata__": {"format": "pt"}}, 0
        for name, (shape, dtype) in layout.items():
            end = start + math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [start, end]}  # fmt: skip
            start = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors does
        self.file = open(self.path, "wb")
        self.file.write(len(text).to_bytes(8, "little") + text)
        self.next = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        shape, dtype = self.layout[name]
        if self.order[self.next] != name or tuple(t.shape) != shape or t.dtype != dtype:
            raise CheckpointError(
                f"{self.path}: {name} {tuple(t.shape)} {t.dtype} written where the header "
                f"expects {self.order[self.next]} {shape} {dtype}"
            )
        self.file.write(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
        self.next += 1

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.file.close()
        if kind is None and self.next != len(self.order):
            raise CheckpointError(f"{self.path}: {self.order[self.next]} was never written")


def _read_dcp(path: Path, names: list[str], md: dict) -> dict[str, torch.Tensor]:
    """Some of a checkpoint's model tensors, in full, in one process (DCP reads only them)."""
    sd = {f"model.{n}": torch.empty(tuple(md[n].size), dtype=md[n].properties.dtype)
          for n in names}  # fmt: skip
    with single_process():
        dcp.load(sd, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return {k[len("model.") :]: v for k, v in sd.items()}
