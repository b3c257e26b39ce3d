"""A Hugging Face model of a registered family with an adapter (Llama, Qwen3, Qwen3-MoE;
config.json + safetensors, one file or sharded) -> a model-only DCP checkpoint `OUTPUT/step-0`
that any layout loads (set checkpoint.initial_load_path = OUTPUT). It streams: one tensor is
in memory at a time (peak memory about the largest tensor, not the model; benchmarks/hf_stream).

    python scripts/convert_from_hf.py HF_FOLDER OUTPUT [--dtype float32] [--flavor 8B]
"""

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

from checkpoint.hf import hf_folder_args, human_bytes, stream_hf_to_dcp
from checkpoint.state import DTYPES
from checkpoint.storage import CheckpointError, step_dir
from models import import_families


def family_for(config: dict, name: str):
    """The registered family that converts this config.json: `name`, or the one whose
    Hugging Face adapter reads its model_type."""
    from checkpoint.hf import hf_adapter
    from models import all_model_specs, get_model_spec

    if name:
        try:
            spec = get_model_spec(name)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        hf_adapter(spec)
        return spec
    kind = config.get("model_type")
    for spec in all_model_specs().values():
        if spec.hf is not None and spec.hf.model_type == kind:
            return spec
    known = ", ".join(f"{s.hf.model_type} ({n})" for n, s in all_model_specs().items() if s.hf)
    raise CheckpointError(
        f"config.json model_type = {kind!r}: no registered family reads it ({known})"
    )


def _shapes(spec, args) -> dict[str, tuple]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in spec.model_cls(args).state_dict().items()}


def compare_with_flavor(spec, args, flavor: str) -> None:
    """Errors when the weights cannot fit the flavor (vocabulary aside: a run uses its
    tokenizer's); warns about other differing settings."""
    if flavor not in spec.flavors:
        raise CheckpointError(
            f"--flavor {flavor} is not a flavor of {spec.name}: {', '.join(spec.flavors)}"
        )
    ref = dataclasses.replace(spec.flavors[flavor], vocab_size=args.vocab_size)
    mine, theirs = _shapes(spec, args), _shapes(spec, ref)
    bad = [f"{k}: checkpoint {mine.get(k)} vs flavor {theirs.get(k)}"
           for k in sorted(mine.keys() | theirs.keys()) if mine.get(k) != theirs.get(k)]  # fmt: skip
    if bad:
        raise CheckpointError(f"the weights do not fit {spec.name} {flavor}: " + "; ".join(bad[:6]))
    for f in dataclasses.fields(ref):
        if f.name != "max_seq_len" and getattr(args, f.name) != getattr(ref, f.name):
            print(
                f"warning: {f.name} = {getattr(args, f.name)} in config.json, "
                f"{getattr(spec.flavors[flavor], f.name)} in flavor {flavor} (the run must use "
                "the checkpoint's value; vocab_size comes from the tokenizer)"
            )


def convert(
    hf_folder: Path, output: Path, dtype: str = "keep", flavor: str = "", model_name: str = ""
) -> Path:
    config = json.loads((Path(hf_folder) / "config.json").read_text())
    spec = family_for(config, model_name)
    args = hf_folder_args(hf_folder, spec, config)
    if flavor:
        compare_with_flavor(spec, args, flavor)
    want = None if dtype == "keep" else DTYPES[dtype]
    layout = {
        "kind": "converted",
        "source": str(hf_folder),
        "dtype": "(from the files)" if want is None else dtype,
        "model": {
            "name": spec.name,
            "flavor": flavor or "(from job_config.json)",
            "args": dataclasses.asdict(args),
        },
        "train_state": {"step": 0, "tokens_seen": 0},
    }
    final = step_dir(Path(output), 0)
    # tensor by tensor: each is read from its file, transformed and written, then dropped
    written = stream_hf_to_dcp(hf_folder, spec, args, output, layout, want)
    dtypes = sorted({str(d).removeprefix("torch.") for _, d in written.values()})
    size = sum(math.prod(s) * d.itemsize for s, d in written.values())
    print(
        f"converted {len(written)} tensors ({human_bytes(size)}, {', '.join(dtypes)}) "
        f"from {hf_folder} to {final}"
    )
    return final


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("hf_folder", type=Path, help="folder with config.json and safetensors")
    p.add_argument("output", type=Path, help="checkpoint folder; step-0 is written inside")
    p.add_argument(
        "--dtype",
        default="keep",
        choices=["keep", *DTYPES],
        help="convert the weights to this dtype (default: keep the file's)",
    )
    p.add_argument("--flavor", default="", help="check the weights fit this model flavor")
    p.add_argument(
        "--model", default="", help="model family in the registry (default: by model_type)"
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
        print(f"convert_from_hf: error: {e}", file=sys.stderr)
        return 2
    try:
        convert(a.hf_folder, a.output, a.dtype, a.flavor, a.model)
    except (CheckpointError, OSError, KeyError) as e:
        print(f"convert_from_hf: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
