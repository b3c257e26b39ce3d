"""How Llama 3 is cut into pipeline stages: layers split by the plan in parallelisms.pipeline,
the token embedding on the first stage, the final norm and output projection on the last."""

from __future__ import annotations

import torch
from torch import nn

from models.llama3.parallelize import parallelize_llama
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import build_pipeline, stage_module_names


def llama_stage_modules(model: nn.Module, parallelism) -> list[list[str]]:
    """Module names of every stage, in pipeline order."""
    return stage_module_names(
        len(model.layers), parallelism, ["tok_embeddings"], ["norm", "output"]
    )


def pipeline_llama(
    model: nn.Module, parallel_dims: ParallelDims, job_config, device: torch.device, loss_fn
):
    """This rank's stages, each parallelized like the whole model, and the schedule.

    Returns (model_parts, schedule, has_first_stage, has_last_stage).
    """
    return build_pipeline(
        model,
        parallel_dims,
        job_config,
        device,
        loss_fn,
        llama_stage_modules(model, job_config.parallelism),
        lambda m: parallelize_llama(m, parallel_dims, job_config, device.type),
    )
