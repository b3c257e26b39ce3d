"""Hugging Face files and DCP checkpoints, for any model family: safetensors (one file or
sharded) in and out, a checkpoint's full model weights read into one process, a model-only
checkpoint written, and the family and arguments a checkpoint records. How a family's names
and config.json map to Hugging Face's is the family's `hf` adapter (`models.HFAdapter`)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint.state import single_process
from checkpoint.storage import CheckpointError, commit, prepare_tmp, read_layout, step_dir
from models import mtp
from models.contract import HFTensor


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


# ----------------------------------------------------------- slices of Hugging Face files
def is_hf_folder(folder: Path) -> bool:
    """A Hugging Face model folder: config.json beside model.safetensors or an index."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and (
        (folder / "model.safetensors").is_file()
        or (folder / "model.safetensors.index.json").is_file()
    )


class HFFiles:
    """The tensors of a Hugging Face folder, read slice by slice with safetensors' `safe_open`
    (`get_slice` copies only the slice asked for), one file open at a time: the file's pages
    a read touches stay mapped, so counted in the process's RSS, only until another file is
    opened or `close()`: at most one shard's worth."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            self.where = dict(json.loads(index.read_text())["weight_map"])
        elif (self.folder / "model.safetensors").is_file():
            with safe_open(str(self.folder / "model.safetensors"), framework="pt") as f:
                self.where = {k: "model.safetensors" for k in f.keys()}
        else:
            raise CheckpointError(
                f"{folder} has neither model.safetensors nor model.safetensors.index.json"
            )
        self._open_name, self._open = None, None

    def _file(self, name: str):
        from safetensors import safe_open

        fname = self.where[name]
        if fname != self._open_name:
            self.close()
            self._open = safe_open(str(self.folder / fname), framework="pt")
            self._open_name = fname
        return self._open

    def close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)  # releases the mapping
        self._open_name, self._open = None, None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        from safetensors.torch import _getdtype

        return _getdtype(self._file(name).get_slice(name).get_dtype())

    def read(self, name: str, region: tuple[slice, ...]) -> torch.Tensor:
        view = self._file(name).get_slice(name)
        return view[region] if region else view[:]


def resolve_source(files: HFFiles, src: HFTensor, ours: str) -> HFTensor:
    """`src` with a tied matrix's stand-in when its own tensor is absent; one error naming
    every HF tensor missing."""
    if src.names and src.names[0] not in files.where and src.tied in files.where:
        return dataclasses.replace(src, names=(src.tied,), tied=None)
    missing = [n for n in src.names if n not in files.where]
    if missing:
        raise CheckpointError(
            f"{files.folder}: no tensor {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
            f" (for our '{ours}'): the folder does not hold this model"
        )
    return src


def read_slice(
    files: HFFiles, src: HFTensor, offsets: tuple[int, ...], shape: tuple[int, ...]
) -> torch.Tensor:
    """The slice [offsets, offsets + shape) of our tensor that `src` describes, reading from
    the files only the HF slices it is made of (a permuted row range: the HF rows it spans)."""
    region = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
    if not src.names:
        return torch.zeros(shape)
    if src.stacked:
        parts = [
            files.read(src.names[j], region[1:]) for j in range(offsets[0], offsets[0] + shape[0])
        ]
        return torch.stack(parts) if parts else torch.empty(shape, dtype=files.dtype(src.names[0]))
    if src.rows is None or not shape or shape[0] == 0:
        return files.read(src.names[0], region)
    hf_rows = src.rows(torch.arange(offsets[0], offsets[0] + shape[0]))
    lo, hi = int(hf_rows.min()), int(hf_rows.max()) + 1
    block = files.read(src.names[0], (slice(lo, hi), *region[1:]))
    return block.index_select(0, hf_rows - lo)


def to_hf_tensors(src: HFTensor, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our full tensor -> the HF tensors `src` says it is (none for a tensor HF lacks)."""
    if not src.names:
        return {}
    if src.stacked:
        return {name: t[j] for j, name in enumerate(src.names)}
    if src.rows is None:
        return {src.names[0]: t}
    out = torch.empty_like(t)
    out[src.rows(torch.arange(len(t)))] = t
    return {src.names[0]: out}


def hf_layout(src: HFTensor, shape: tuple[int, ...], dtype) -> dict[str, tuple]:
    """{HF name: (shape, dtype)} of the HF tensors `to_hf_tensors` makes of one of ours."""
    return {k: (shape[1:] if src.stacked else shape, dtype) for k in src.names}


def tensor_map(spec, args) -> Callable[[str], HFTensor]:
    """(our tensor name) -> HFTensor for a family, or one error when its adapter lacks it."""
    adapter = hf_adapter(spec)
    if adapter.tensor is None:
        raise CheckpointError(
            f"model family '{spec.name}': its HFAdapter has no `tensor` description (where each "
            "of its tensors is in Hugging Face files), which streaming conversion and runs "
            "loading or saving Hugging Face folders need: add one (models/contract.py HFTensor)"
        )
    return lambda name: adapter.tensor(name, args)


def check_hf_names(files: HFFiles, sources: dict[str, HFTensor]) -> None:
    """Every HF tensor of the folder is one of ours (rotary caches aside)."""
    used = {n for s in sources.values() for n in (*s.names, *([s.tied] if s.tied else []))}
    extra = sorted(
        n for n in files.where if n not in used and not n.endswith("rotary_emb.inv_freq")
    )
    if extra:
        raise CheckpointError(
            f"{files.folder}: unexpected tensors {extra[:10]}: the folder does not hold this "
            "model (a different family, layer count or expert count?)"
        )


def fill_from_hf(msd: dict, folder: Path, spec, args) -> None:
    """Fills a live model's state dict (`get_model_state_dict`: full tensors, or DTensors in
    any layout: FSDP, TP, EP shards, a pipeline stage's part) in place from a Hugging Face
    folder: each rank reads only the HF slices its shards are made of (their global offsets
    from DTensor's own placement arithmetic), one file open at a time."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    files = HFFiles(folder)
    where = tensor_map(spec, args)
    with torch.device("meta"):
        every = spec.model_cls(args).state_dict().keys()  # all stages': the folder's names
    check_hf_names(files, {n: resolve_source(files, where(n), n) for n in every})
    sources = {n: resolve_source(files, where(n), n) for n in msd}
    bad = []
    for n, src in sources.items():
        want = tuple(msd[n].shape[1:] if src.stacked else msd[n].shape)
        got = {files.shape(h) for h in src.names}
        if got - {want}:
            bad.append(f"{src.names[0]}: {sorted(got)[0]} where {n} is {want}")
        if src.stacked and len(src.names) != msd[n].shape[0]:
            bad.append(f"{n}: {msd[n].shape[0]} rows, {len(src.names)} HF tensors")
    if bad:
        raise CheckpointError(
            f"{folder} does not fit this run's model: {'; '.join(bad[:6])} (is the run's "
            "[model] the checkpoint's? config.json says what it holds)"
        )
    by_file = sorted(msd, key=lambda n: files.where.get(next(iter(sources[n].names), ""), ""))
    try:
        with torch.no_grad():
            for n in by_file:
                t = msd[n]
                if isinstance(t, DTensor):
                    shape, offset = compute_local_shape_and_global_offset(
                        t.shape, t.device_mesh, t.placements
                    )
                    local = t.to_local()
                else:
                    shape, offset, local = tuple(t.shape), (0,) * t.dim(), t
                if local.numel():
                    local.copy_(read_slice(files, sources[n], tuple(offset), tuple(shape)))
    finally:
        files.close()


def hf_folder_args(folder: Path, spec, config: dict | None = None):
    """The family's args of the model a Hugging Face folder holds: config.json's, less what
    the folder lacks where the family says how (`HFAdapter.args_for_files`)."""
    adapter = hf_adapter(spec)
    if config is None:
        config = json.loads((Path(folder) / "config.json").read_text())
    try:
        args = adapter.args_from_config(config)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{folder}/config.json: {e}") from None
    if adapter.args_for_files is not None:
        args = adapter.args_for_files(args, set(HFFiles(folder).where))
    return args


def hf_load_problems(folder: Path, spec, args, model_only: bool) -> list[str]:
    """Before any process group: what stops a run from starting from the Hugging Face folder
    `folder` (checkpoint.initial_load_path): the family's adapter, config.json's model and
    its shapes against the run's (the vocabulary aside: the run's comes from its tokenizer)."""
    where = f"checkpoint.initial_load_path = {folder} (a Hugging Face folder)"
    if not model_only:
        return [f"{where} holds weights only: set checkpoint.initial_load_model_only = true"]
    try:
        tensor_map(spec, args)
        check_hf_config(folder, spec, args, spec.function_args)
        theirs = hf_folder_args(folder, spec)
    except CheckpointError as e:
        return [f"{where}: {e}"]
    theirs = dataclasses.replace(theirs, vocab_size=args.vocab_size)
    with torch.device("meta"):
        mine = {k: tuple(v.shape) for k, v in spec.model_cls(args).state_dict().items()}
        other = {k: tuple(v.shape) for k, v in spec.model_cls(theirs).state_dict().items()
                 if k in mine or not k.startswith(f"{mtp.ATTRIBUTE}.")}  # fmt: skip
        # (a run without multi-token prediction leaves a folder's prediction layers unread)
    bad = [f"{k}: {other.get(k)} there, {mine.get(k)} here"
           for k in sorted(mine.keys() | other.keys()) if mine.get(k) != other.get(k)]  # fmt: skip
    if bad:
        return [
            f"{where}: config.json's model has other shapes than the run's [model] "
            f"({'; '.join(bad[:4])}): set [model] to the checkpoint's shape"
        ]
    return []


def check_hf_config(folder: Path, spec, args, function_args=()) -> None:
    """config.json describes this family and the run's model: the same model_type, and the
    same values of the args the weights' functions depend on (RoPE, norms)."""
    adapter = hf_adapter(spec)
    config = json.loads((Path(folder) / "config.json").read_text())
    if config.get("model_type") != adapter.model_type:
        raise CheckpointError(
            f"{folder}/config.json model_type = {config.get('model_type')!r}, but the run's "
            f"model.name = {spec.name} reads {adapter.model_type!r} checkpoints"
        )
    try:
        theirs = adapter.args_from_config(config)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{folder}/config.json: {e}") from None
    diff = [f"{k} = {getattr(theirs, k)} there, {getattr(args, k)} here"
            for k in function_args if getattr(theirs, k, None) != getattr(args, k, None)]  # fmt: skip
    if diff:
        raise CheckpointError(
            f"{folder}/config.json differs from the run's model: {'; '.join(diff)} (set the "
            "run's [model] to the checkpoint's values)"
        )


# Files of a Hugging Face tokenizer, copied into an export when they sit beside the run's
# tokenizer file (a tiktoken or sentencepiece file alone is not one transformers reads).
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
    if not model.get("args") or not model.get("name"):
        raise CheckpointError(
            f"{path}/layout.json does not record the model family and its arguments (model.name "
            "and model.args), so the checkpoint's architecture is unknown: use a step folder "
            "that train.py saved (it writes layout.json beside every checkpoint)"
        )
    try:
        spec = get_model_spec(model["name"])
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


def write_dcp_model(
    sd: dict[str, torch.Tensor], out_folder: Path, layout: dict, produce: Callable | None = None
) -> Path:
    """A model-only `step-0` checkpoint in `out_folder`, committed like a training save.
    With `produce` (our name -> tensor), `sd` holds meta tensors of the shapes and dtypes to
    write and each tensor is made when DCP writes it, into a file of its own, then dropped."""
    final = step_dir(Path(out_folder), 0)
    tmp = prepare_tmp(final)
    with single_process():
        if produce is None:
            dcp.save({"model": sd}, checkpoint_id=str(tmp), no_dist=True)
        else:
            dcp.save(
                {"model": sd},
                storage_writer=FileSystemWriter(str(tmp), single_file_per_rank=False),
                planner=_ProducingPlanner(produce),
                no_dist=True,
            )
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


class _ProducingPlanner(DefaultSavePlanner):
    """DCP's save planner, with each tensor made when the writer asks for it: DCP plans from
    shapes and dtypes only, and its writer resolves items one at a time on CPU (and, with
    `single_file_per_rank=False`, keeps one item per file: it holds a file's tensors until the
    file is closed)."""

    def __init__(self, produce: Callable[[str], torch.Tensor]):
        super().__init__(dedup_save_to_lowest_rank=False)
        self.produce = produce

    def resolve_data(self, write_item):
        return self.produce(write_item.index.fqn.removeprefix("model."))


def stream_hf_to_dcp(folder: Path, spec, args, output: Path, layout: dict, dtype=None) -> dict:
    """A Hugging Face folder -> a model-only DCP checkpoint, one tensor in memory at a time.
    Returns {our name: (shape, dtype)} of what was written."""
    files = HFFiles(folder)
    where = tensor_map(spec, args)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in spec.model_cls(args).state_dict().items()}
    sources = {n: resolve_source(files, where(n), n) for n in shapes}
    check_hf_names(files, sources)
    bad = []
    for n, src in sources.items():
        want = shapes[n][1:] if src.stacked else shapes[n]
        got = {files.shape(h) for h in src.names}
        if got - {want}:
            bad.append(f"{src.names[0]}: {sorted(got)[0]} where {n} needs {want}")
    if bad:
        raise CheckpointError(f"{folder}: tensors of the wrong shape: {'; '.join(bad[:6])}")
    dtypes = {n: dtype or (files.dtype(s.names[0]) if s.names else torch.float32)
              for n, s in sources.items()}  # fmt: skip
    meta = {n: torch.empty(shapes[n], dtype=dtypes[n], device="meta") for n in shapes}

    def produce(n: str) -> torch.Tensor:
        return read_slice(files, sources[n], (0,) * len(shapes[n]), shapes[n]).to(dtypes[n])

    try:
        write_dcp_model(meta, output, layout, produce)
    finally:
        files.close()
    return {n: (shapes[n], dtypes[n]) for n in shapes}


def total_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def human_bytes(n: int) -> str:
    if n <= 0:
        return "0 B"
    k = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**k:.2f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][k]}"
