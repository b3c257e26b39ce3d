"""A preset scaled down to a few ranks and a tiny shape, with every feature it ships kept on.

    python scripts/scaled_preset.py llama3_405b            # print the torchrun command
    python scripts/scaled_preset.py llama3_405b --run      # and run it (gloo on CPU)
    python scripts/scaled_preset.py qwen3_8b --run --device cuda   # NCCL on the GPUs

A preset is tuned for a cluster (TP 8 x PP 8 x FSDP on 512 GPUs, say). This keeps what decides
how a step is computed - the model family and its tied or untied output, every parallel
dimension (each degree above 1 becomes 2, FSDP over 2 ranks), the pipeline schedule, the
ZeRO stage, activation checkpointing and its option, compile and its components, mixed
precision, document masking, checkpointing and its mode - and shrinks the rest: the family's
debug flavor at width 64 (4 heads, 2 KV heads) with as many layers as the pipeline needs, 64
tokens per sequence, the bundled corpus and tokenizer, 6 steps at a learning rate that shows
the loss falling. `tests/integration/test_presets.py` runs every preset this way in CI.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
SEQ_LEN = 64


def _two(degree: int) -> int:
    """A parallel degree above 1 becomes 2 (-1, "whatever is left", too: at scale it is > 1)."""
    return 1 if degree == 1 else 2


def tiny_flavor(family: str, flavor: str) -> str:
    """The family's debug flavor with the same tied or untied output projection as `flavor`."""
    from models import get_model_spec

    flavors = get_model_spec(family).flavors
    tied = getattr(flavors[flavor], "tie_embeddings", False)
    debug = [n for n in flavors if n.startswith("debugmodel")]
    return next(n for n in debug if getattr(flavors[n], "tie_embeddings", False) == tied)


def scaled_preset(name: str, device: str = "cpu") -> tuple[int, list[str]]:
    """(ranks, train.py arguments) of preset `name` scaled down (see the module doc)."""
    from job_config import parse_args
    from models import get_model_spec
    from parallelisms.pipeline import is_single_stage, schedule_class

    cfg = parse_args(["--config", name], check=False)
    p, ac, comp, t = cfg.parallelism, cfg.activation_checkpoint, cfg.compile, cfg.training
    tp, pp, cp, ep = (_two(d) for d in (p.tensor_parallel_degree, p.pipeline_parallel_degree,
                                        p.context_parallel_degree, p.expert_parallel_degree))  # fmt: skip
    rep, shard = _two(p.data_parallel_replicate_degree), _two(p.data_parallel_shard_degree)
    stages = 1 if pp == 1 or is_single_stage(schedule_class(p.pipeline_parallel_schedule)) else 2
    layers = max(2, pp * stages)
    nproc = pp * rep * shard * cp * tp
    tiny = tiny_flavor(cfg.model.name, cfg.model.flavor)
    shape = get_model_spec(cfg.model.name).flavors[tiny]
    kv_heads = "4" if shape.n_kv_heads == shape.n_heads else "2"  # a family without GQA keeps none
    args = [
        "--config", name,
        "--model.flavor", tiny,
        "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", kv_heads,
        "--model.n_layers", str(layers), "--model.tokenizer_path", "",
        "--training.dataset", "sample", "--training.dataset_path", "",
        "--training.stream_shards", "1",  # the offline sample corpus is no stream
        "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", "4",
        "--training.global_batch_size", "-1", "--training.steps", str(STEPS),
        "--training.device", device,
        "--optimizer.lr", "1e-3" if ep > 1 or cfg.model.name.endswith("moe") else "3e-3",
        "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "constant",
        "--metrics.log_freq", "1", "--validation.steps", "2",
        # the layout, spelled out (so a test can derive what must be built from the arguments)
        "--parallelism.data_parallel_replicate_degree", str(rep),
        "--parallelism.data_parallel_shard_degree", str(shard),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.pipeline_parallel_degree", str(pp),
        "--parallelism.context_parallel_degree", str(cp),
        "--parallelism.expert_parallel_degree", str(ep),
        "--parallelism.zero_stage", str(p.zero_stage),
        "--activation_checkpoint.mode", ac.mode,
        "--activation_checkpoint.selective_ac_option", ac.selective_ac_option,
        "--compile.enable", str(comp.enable).lower(),
        "--compile.components", ",".join(comp.components),
        "--training.mixed_precision_param", t.mixed_precision_param,
    ]  # fmt: skip
    if pp > 1:
        args += ["--parallelism.pipeline_parallel_schedule", p.pipeline_parallel_schedule]
    return nproc, _drop_unused(args, cfg)


def _drop_unused(args: list[str], cfg) -> list[str]:
    """Leaves out the options the scaled run would ignore (the config check refuses an option
    that has no effect): the validation batches when validation is off, a selective option
    without selective AC, compile components without compile, degrees of 1."""
    out = []
    for key, value in zip(args[::2], args[1::2]):
        if key == "--validation.steps" and not cfg.validation.enable:
            continue
        if key == "--activation_checkpoint.selective_ac_option" and (
            cfg.activation_checkpoint.mode != "selective"
        ):
            continue
        if key == "--compile.components" and not cfg.compile.enable:
            continue
        if key.endswith("_degree") and "shard" not in key and value == "1":
            continue
        out += [key, value]
    return out


def command(name: str, dump_folder: str, device: str = "cpu") -> list[str]:
    nproc, args = scaled_preset(name, device)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "train.py", *args, "--job.dump_folder", dump_folder]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", help="a preset name (configs/NAME.toml) or a TOML file")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dump-folder", default="", help="default: ./outputs/scaled_<preset>")
    parser.add_argument("--run", action="store_true", help="run it, not only print it")
    a = parser.parse_args(argv)
    folder = a.dump_folder or f"./outputs/scaled_{Path(a.preset).stem}"
    cmd = command(a.preset, folder, a.device)
    print(shlex.join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT) if a.run else 0


if __name__ == "__main__":
    sys.exit(main())
