"""Where each rank's memory goes during one training step: the peak of live tensors by kind
(parameters, gradients, optimizer state, activations, FSDP's gathered parameters and
collective buffers, temporaries).

    torchrun --standalone --nproc_per_node 4 scripts/memory_breakdown.py \\
        [--config debug_model] [--output FILE.json] [--section.key value ...]

It builds the layout exactly as train.py does (same config, checks, model construction,
optimizer and step function), runs one warm-up step on random tokens of the configured
shape (it allocates the optimizer state), then tracks one step with torch's MemTracker
(FSDPMemTracker under ZeRO-3) and prints the peak per rank. Live-tensor bytes are what CUDA's
`max_memory_allocated` counts, and on CPU they do not depend on what glibc keeps: the fair
way to compare layouts' memory there (peak RSS, which bench.py reports, also holds the
runtime and the heap glibc keeps after frees). Limits: no pipeline parallelism, no gradient
accumulation (the tracker follows one forward per module), eager only (compiled kernels
allocate outside the dispatcher it watches). The tracked step runs slower.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MIB = 2**20


def tracker_for(model, optimizer):
    """FSDPMemTracker for an FSDP2 model (it knows its sharded/unsharded states and
    buffers), MemTracker otherwise."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return FSDPMemTracker(model, optimizer)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def breakdown(cfg, world_size: int, local_rank: int) -> dict:
    """One warm-up and one tracked step of cfg's layout; this rank's peak by kind (bytes)."""
    from training.preflight import check_config
    from training.trainer import start_runtime

    dims = check_config(cfg, world_size)
    check_supported(cfg, dims)
    device = start_runtime(cfg, dims, local_rank)
    step, parts, optimizer = training_step(cfg, dims, device)
    step()  # the warm-up: allocates the optimizer state
    tracker = tracker_for(parts[0], optimizer)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[device]
    kinds = {getattr(k, "value", str(k)): int(v) for k, v in peak.items() if v}
    return {"kinds": kinds}


def check_supported(cfg, dims) -> None:
    """Exits on a layout the tracker cannot follow (see the module's limits)."""
    t = cfg.training
    if dims.pp_enabled:
        raise SystemExit("memory_breakdown: pipeline parallel layouts are not supported")
    if t.global_batch_size not in (-1, t.local_batch_size * dims.dp):
        raise SystemExit("memory_breakdown: gradient accumulation is not supported")
    if cfg.compile.enable:
        raise SystemExit("memory_breakdown: compiled kernels are not tracked; drop --compile")


def training_step(cfg, dims, device):
    """The layout's model parts and optimizer as train.py builds them, and a function that runs
    one optimizer step of them on one batch of random tokens: (step, model parts, optimizer)."""
    import torch

    from models import get_model_spec, model_args_for
    from training.inputs import sequence_inputs
    from training.loss import StepLoss, cross_entropy_sum
    from training.optimizer import build_optimizer, no_decay_patterns
    from training.step import clip_grad_norm_, train_step
    from training.trainer import (
        build_model_parts,
        build_step_setup,
        load_tokenizer,
        multi_token_prediction,
        sequence_split,
    )

    t = cfg.training
    tokenizer = load_tokenizer(cfg)
    model_args = model_args_for(cfg, t.seq_len, tokenizer.vocab_size)
    split = sequence_split(cfg, dims, model_args)  # this rank's CP shard of each sequence
    loss_fn = StepLoss(cross_entropy_sum)
    spec = get_model_spec(cfg.model.name)
    built = build_model_parts(cfg, spec, dims, model_args, device, loss_fn)
    parts = built.parts
    optimizer = build_optimizer(parts, cfg.optimizer, device.type, no_decay_patterns(cfg))
    setup = build_step_setup(cfg, dims, device, built, loss_fn, split)
    multi_token_prediction(model_args, parts, loss_fn)
    params = [p for part in parts for p in part.parameters()]
    # the CP ranks of one data-parallel replica hold shards of the same sequences
    gen = torch.Generator().manual_seed(cfg.debug.seed + dims.coordinate("dp")[0])
    shape = (t.local_batch_size, t.seq_len)
    x, y = (torch.randint(0, model_args.vocab_size, shape, generator=gen).to(device) for _ in "xy")
    one_document = torch.zeros(shape, dtype=torch.int32, device=device)  # per sequence
    batch = [sequence_inputs(split, x, y, one_document)]

    def step():
        train_step(setup, batch)
        clip_grad_norm_(params, t.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, parts, optimizer


def estimated_activations(cfg, world_size: int) -> int:
    """The estimator's activation bytes for rank 0 of this layout (`planning.memory`: 16-bit
    activations, fused attention), to set beside the measured ones."""
    import torch

    from models import get_model_spec, model_args_for
    from planning.memory import layer_attention_specs, rank_activations
    from training.preflight import check_config
    from training.trainer import load_tokenizer

    dims = check_config(cfg, world_size)
    args = model_args_for(cfg, cfg.training.seq_len, load_tokenizer(cfg).vocab_size)
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        specs = tuple(dict.fromkeys(layer_attention_specs(spec.model_cls(args))))
    block = spec.block_activation_bytes
    act = rank_activations(cfg, args, dims, 0, args.n_layers, True, block, specs=specs)
    return int(act.total)


def format_table(per_rank: list[dict], title: str) -> str:
    kinds = list(dict.fromkeys(k for r in per_rank for k in r["kinds"] if k != "Total"))
    head = ["rank", *kinds, "Total"]
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(per_rank):
        cells = [f"{r['kinds'].get(k, 0) / MIB:,.1f}" for k in [*kinds, "Total"]]
        lines.append("| " + " | ".join([str(i), *cells]) + " |")
    lines.append("")
    lines.append("MiB; peak of live tensors during one step, by kind (torch MemTracker)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from job_config import ConfigError
    from parallelisms.parallel_dims import ParallelismError
    from training.distributed import LaunchError, cleanup, launch_env
    from training.preflight import load_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="debug_model")
    ap.add_argument("--output", help="also write the per-rank numbers to this JSON file")
    ns, extra = ap.parse_known_args(argv)
    try:
        cfg = load_config(["--config", ns.config, *extra])  # honours --job.custom_import
        rank, local_rank, world_size = launch_env()
        mine = breakdown(cfg, world_size, local_rank)
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, mine)
    except (ConfigError, ParallelismError, LaunchError) as e:
        print(f"memory_breakdown: {e}", file=sys.stderr)
        return 2
    finally:
        cleanup()
    if rank == 0:
        layout = f"{world_size} rank(s), zero_stage {cfg.parallelism.zero_stage}"
        print(format_table(per_rank, f"memory breakdown: {layout}, {' '.join(extra)}"))
        estimate = estimated_activations(cfg, world_size)
        print(f"estimated activations of rank 0 (planning.memory): {estimate / MIB:,.1f} MiB")
        if ns.output:
            record = {"argv": ["--config", ns.config, *extra], "world_size": world_size}
            record["estimated_activations"] = estimate
            Path(ns.output).write_text(json.dumps({**record, "ranks": per_rank}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
