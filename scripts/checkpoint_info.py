"""Describes a checkpoint: step, the layout it was saved with, its tensors and total size.

python scripts/checkpoint_info.py PATH          # a step-N folder, or a folder of them
python scripts/checkpoint_info.py PATH --summary  # without the per-tensor listing
"""

import argparse
import pickle
import sys
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoint.hf import human_bytes
from checkpoint.storage import CheckpointError, read_layout, resolve_load_path


def _small_state(path: Path, metadata: dict) -> dict:
    """The pickled data-loader state and the train-state counters, when present."""
    want = {}
    if "dataloader.state" in metadata:
        want["dataloader"] = {"state": b""}
    keys = [k for k in ("train_state.step", "train_state.tokens_seen") if k in metadata]
    if keys:
        want["train_state"] = {k.split(".", 1)[1]: 0 for k in keys}
    if want:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(want, storage_reader=FileSystemReader(str(path)), no_dist=True)
    if "dataloader" in want:
        want["dataloader"] = pickle.loads(want["dataloader"]["state"])
    return want


def describe(path: Path, summary: bool = False) -> str:
    path = resolve_load_path(Path(path))
    layout = read_layout(path)
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    lines = [f"checkpoint: {path}"]
    lines.append(
        f"step: {layout.get('step')}   kind: {layout.get('kind', '?')}   "
        f"contents: {', '.join(layout.get('contents', []))}"
    )
    degrees = layout.get("parallelism") or {}
    lines.append(
        " ".join(
            [f"saved with: world_size={layout.get('world_size')}"]
            + [f"{k}={v}" for k, v in degrees.items()]
        )
    )
    model = layout.get("model") or {}
    if model:
        lines.append(
            f"model: {model.get('name')} {model.get('flavor')}   dtype: {layout.get('dtype', '?')}"
        )
    for key in ("saved_at", "torch_version", "async_mode", "source"):
        if key in layout:
            lines.append(f"{key}: {layout[key]}")
    small = _small_state(path, metadata)
    if "train_state" in small:
        lines.append(
            "train state: " + ", ".join(f"{k}={v}" for k, v in small["train_state"].items())
        )
    if "dataloader" in small:
        lines.append(f"data loader: {small['dataloader']}")
    tensor_bytes, n_tensors, n_objects, rows = 0, 0, 0, []
    for key in sorted(metadata):
        md = metadata[key]
        if isinstance(md, TensorStorageMetadata):
            numel = 1
            for s in md.size:
                numel *= s
            nbytes = numel * md.properties.dtype.itemsize
            tensor_bytes += nbytes
            n_tensors += 1
            dtype = str(md.properties.dtype).removeprefix("torch.")
            rows.append(f"  {key:<60} {str(list(md.size)):<16} {dtype:<9} {human_bytes(nbytes)}")
        else:
            n_objects += 1
            rows.append(f"  {key:<60} (object)")
    if not summary:
        lines.append("entries:")
        lines.extend(rows)
    disk = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    lines.append(
        f"total: {n_tensors} tensors, {tensor_bytes} bytes ({human_bytes(tensor_bytes)})"
        f"; {n_objects} other entries; {human_bytes(disk)} on disk"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("path", type=Path)
    p.add_argument("--summary", action="store_true", help="omit the per-tensor listing")
    a = p.parse_args(argv)
    try:
        print(describe(a.path, a.summary))
    except (CheckpointError, OSError) as e:
        print(f"checkpoint_info: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
