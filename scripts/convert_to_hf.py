"""A meshtrain DCP checkpoint (any layout; a step-N folder, an export, or a folder of them,
whose latest is used) -> the Hugging Face layout of the family it records (Llama, Qwen3,
Qwen3-MoE): config.json + safetensors. It streams: one tensor is in memory at a time (peak
memory about the largest tensor, not the model; benchmarks/hf_stream).

    python scripts/convert_to_hf.py CHECKPOINT OUTPUT [--dtype bfloat16] [--max_shard_gb 5]
"""

import argparse
import json
import math
import sys
from pathlib import Path

from checkpoint.hf import hf_adapter, human_bytes, model_from_layout
from checkpoint.hf_write import stream_dcp_to_hf
from checkpoint.state import DTYPES
from checkpoint.storage import CheckpointError, resolve_load_path
from models import import_families


def convert(
    checkpoint: Path, output: Path, dtype: str = "keep", max_shard_bytes: int = 5 * 2**30
) -> list[str]:
    held = sorted(p.name for p in Path(output).glob("*") if p.suffix in (".safetensors", ".json"))
    if held:  # a second export beside the first would leave stale weight files that load
        raise CheckpointError(
            f"{output} already holds {', '.join(held[:4])}{' ...' if len(held) > 4 else ''}: "
            "export into a new or empty folder (or remove those files first)"
        )
    path = resolve_load_path(checkpoint)
    spec, args = model_from_layout(path)
    adapter = hf_adapter(spec)  # the family the checkpoint records decides the format
    # file by file of the output: only the tensors of one output file are in memory at a time
    files, shapes, out_dtype = stream_dcp_to_hf(
        path, spec, args, Path(output), None if dtype == "keep" else DTYPES[dtype], max_shard_bytes
    )
    config = adapter.config_from_args(args, out_dtype)
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    size = sum(math.prod(s) for s in shapes.values()) * out_dtype.itemsize
    print(
        f"converted {len(shapes)} tensors ({human_bytes(size)}) from {path} to "
        f"{output}: config.json, {', '.join(files)}"
    )
    return files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", type=Path)
    p.add_argument("output", type=Path)
    p.add_argument("--dtype", default="keep", choices=["keep", *DTYPES])
    p.add_argument(
        "--max_shard_gb",
        type=float,
        default=5.0,
        help="split the safetensors into files of at most this size",
    )
    p.add_argument(
        "--job.custom_import",
        dest="custom_import",
        default="",
        help="module or path that registers a model family outside the tree (as train.py)",
    )
    a = p.parse_args(argv)
    try:
        import_families(a.custom_import)  # a family registered outside the tree
    except ValueError as e:
        print(f"convert_to_hf: error: {e}", file=sys.stderr)
        return 2
    try:
        convert(a.checkpoint, a.output, a.dtype, int(a.max_shard_gb * 2**30))
    except (CheckpointError, OSError, KeyError) as e:
        print(f"convert_to_hf: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
