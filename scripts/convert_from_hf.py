"""Hugging Face Llama (config.json + safetensors, one file or sharded) -> a model-only DCP
checkpoint `OUTPUT/step-0` that any layout loads (set checkpoint.initial_load_path = OUTPUT).

    python scripts/convert_from_hf.py HF_FOLDER OUTPUT [--dtype float32] [--flavor 8B]
"""

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint.hf import (  # noqa: E402
    LAYER_KEYS,
    TOP_KEYS,
    args_from_hf_config,
    hf_to_meta,
    human_bytes,
    read_hf_weights,
    total_bytes,
    write_dcp_model,
)
from checkpoint.state import DTYPES  # noqa: E402
from checkpoint.storage import CheckpointError  # noqa: E402

SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "kv_heads", "ffn_hidden_dim")


def compare_with_flavor(args, name: str, flavor: str) -> None:
    """Errors when the weights cannot fit the flavor; warns about other differences."""
    from models import get_model_spec

    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise CheckpointError(
            f"--flavor {flavor} is not a flavor of {name}: {', '.join(spec.flavors)}"
        )
    ref = spec.flavors[flavor]
    bad = [
        f"{f}: checkpoint {getattr(args, f)} vs flavor {getattr(ref, f)}"
        for f in SHAPE_FIELDS
        if getattr(args, f) != getattr(ref, f)
    ]
    if bad:
        raise CheckpointError(f"the weights do not fit {name} {flavor}: " + "; ".join(bad))
    for f in ("norm_eps", "rope_theta", "use_scaled_rope", "vocab_size"):
        if getattr(args, f) != getattr(ref, f):
            print(
                f"warning: {f} = {getattr(args, f)} in config.json, {getattr(ref, f)} in "
                f"flavor {flavor} (vocab_size: the run uses the tokenizer's; the others "
                "must match at load time: model.rope_scaling sets use_scaled_rope)"
            )


def convert(
    hf_folder: Path, output: Path, dtype: str = "keep", flavor: str = "", model_name: str = "llama3"
) -> Path:
    config = json.loads((Path(hf_folder) / "config.json").read_text())
    args = args_from_hf_config(config)
    if flavor:
        compare_with_flavor(args, model_name, flavor)
    sd = hf_to_meta(read_hf_weights(hf_folder), args, config.get("tie_word_embeddings", False))
    expected = {k for k, _ in TOP_KEYS} | {
        f"layers.{i}.{k}" for i in range(args.n_layers) for k, _ in LAYER_KEYS
    }
    missing, extra = sorted(expected - sd.keys()), sorted(sd.keys() - expected)
    if missing or extra:
        raise CheckpointError(
            f"{hf_folder}: missing tensors {missing[:10]}, unexpected "
            f"{extra[:10]} for {args.n_layers} layers"
        )
    if dtype != "keep":
        sd = {k: v.to(DTYPES[dtype]) for k, v in sd.items()}
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in sd.values()})
    layout = {
        "kind": "converted",
        "source": str(hf_folder),
        "dtype": ",".join(dtypes),
        "model": {
            "name": model_name,
            "flavor": flavor or "(from config.json)",
            "args": dataclasses.asdict(args),
        },
        "train_state": {"step": 0, "tokens_seen": 0},
    }
    final = write_dcp_model(sd, output, layout)
    print(
        f"converted {len(sd)} tensors ({human_bytes(total_bytes(sd))}, {', '.join(dtypes)}) "
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
    p.add_argument("--model", default="llama3", help="model name in the registry")
    a = p.parse_args(argv)
    try:
        convert(a.hf_folder, a.output, a.dtype, a.flavor, a.model)
    except (CheckpointError, OSError, KeyError) as e:
        print(f"convert_from_hf: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
