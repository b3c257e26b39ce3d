"""How Llama 3 is cut into pipeline stages: layers split by the plan in parallelisms.pipeline,
the token embedding on the first stage, the final norm and output projection on the last."""

from __future__ import annotations

import torch
from torch import nn

from models.llama3.parallelize import parallelize_llama
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import (
    build_schedule,
    build_stages,
    is_v_schedule,
    microbatch_count,
    plan_stage_layers,
    schedule_class,
    stage_ids_for_rank,
)


def llama_stage_modules(model: nn.Module, parallelism) -> list[list[str]]:
    """Module names of every stage, in pipeline order."""
    pp = parallelism.pipeline_parallel_degree
    plan = plan_stage_layers(
        len(model.layers),
        pp,
        parallelism.pipeline_parallel_schedule,
        layers_per_stage=parallelism.pipeline_parallel_layers_per_stage,
        split_points=parallelism.pipeline_parallel_split_points,
    )
    names = [[f"layers.{i}" for i in layers] for layers in plan]
    names[0].insert(0, "tok_embeddings")
    names[-1].extend(["norm", "output"])
    return names


def pipeline_llama(
    model: nn.Module, parallel_dims: ParallelDims, job_config, device: torch.device, loss_fn
):
    """Splits the meta-device model into this rank's stages, parallelizes each one over the
    other mesh dimensions, and builds the schedule.

    Returns (model_parts, schedule, has_first_stage, has_last_stage).
    """
    p = job_config.parallelism
    pp_mesh = parallel_dims.dim("pp")
    pp = pp_mesh.size()
    names = llama_stage_modules(model, p)
    cls = schedule_class(p.pipeline_parallel_schedule)
    stage_ids = stage_ids_for_rank(pp_mesh.get_local_rank(), pp, len(names), is_v_schedule(cls))
    n_micro = microbatch_count(
        p.pipeline_parallel_schedule,
        job_config.training.local_batch_size,
        p.pipeline_parallel_microbatch_size,
        pp,
        len(names),
    )
    parts, stages = build_stages(
        model,
        names,
        stage_ids,
        pp_mesh.get_group(),
        device,
        lambda m: parallelize_llama(m, parallel_dims, job_config, device.type),
    )
    schedule = build_schedule(stages, p.pipeline_parallel_schedule, n_micro, loss_fn)
    return parts, schedule, any(s.is_first for s in stages), any(s.is_last for s in stages)
