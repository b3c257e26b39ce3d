"""`checkpoint.create_seed_checkpoint`: the full model initialised once, on CPU in one process,
saved as the model-only `step-0` checkpoint that any layout then loads (parity tests)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from checkpoint.manager import _Writer, layout_info, model_info
from checkpoint.state import single_process
from checkpoint.storage import CheckpointError, commit, list_checkpoints, prepare_tmp, step_dir

logger = logging.getLogger("meshtrain")


def build_full_model(cfg, vocab_size: int | None):
    """The plain model, materialised on CPU and initialised as in every training layout."""
    from models import meta_model_for
    from models.init_weights import materialize

    _, _, model = meta_model_for(cfg, cfg.training.seq_len, vocab_size, CheckpointError)
    return materialize(model, cfg.debug.seed, "cpu")


def create_seed_checkpoint(cfg, world_size: int) -> Path:
    """Writes `<dump_folder>/<folder>/step-0` (weights only) and returns its path."""
    if world_size != 1:
        raise CheckpointError(
            f"checkpoint.create_seed_checkpoint runs in one process, not {world_size}: launch "
            "it with `python train.py ...` or torchrun --nproc_per_node 1."
        )
    folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
    existing = list_checkpoints(folder, warn=False)
    if existing:
        raise CheckpointError(
            f"{folder} already holds checkpoints ({', '.join(p.name for _, p in existing)}); "
            "a seed checkpoint goes into an empty folder and never replaces saved ones."
        )
    from data.tokenizer import build_tokenizer

    t0 = time.perf_counter()
    model = build_full_model(cfg, build_tokenizer(cfg.model.tokenizer_path).vocab_size)
    final = step_dir(folder, 0)
    tmp = prepare_tmp(final)
    with single_process():
        dcp.save({"model": model.state_dict()}, storage_writer=_Writer(tmp), no_dist=True)
    layout = {
        "step": 0,
        "kind": "seed",
        "contents": ["model"],
        **layout_info(None),
        "model": model_info(cfg, [model]),
        "dtype": "float32",
        "train_state": {"step": 0, "tokens_seen": 0},
        "seed": cfg.debug.seed,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "torch_version": torch.__version__,
    }
    commit(tmp, final, layout)
    logger.info("seed checkpoint written to %s in %.1f s", final, time.perf_counter() - t0)
    return final
