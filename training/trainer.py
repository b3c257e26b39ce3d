"""Builds a run from a validated config (`build_run`, from named pieces) and runs it:
`run_training` = build, `training.loop.train_loop`, teardown."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from data.dataloader import build_dataloader
from data.sample_corpus import default_cache_dir
from data.tokenizer import build_tokenizer
from job_config import JobConfig
from metrics import MetricsLogger, device_peak_flops, flops_per_token
from metrics.memory import process_rss_gib
from metrics.profiling import MemorySnapshot, PhaseTimer, Profiler
from models import get_model_spec, model_args_for, mtp
from models.contract import ModelSpec
from models.init_weights import materialize
from models.mixed_precision import in_weight_dtype, mixed_precision_dtypes, weight_dtype
from parallelisms.compile import key_compile_caches_to_rank, maybe_compile_loss
from parallelisms.decoder import AssemblyConfig, ModelParts, assemble_model
from parallelisms.layout_record import built_layout, summarize, write_layout
from parallelisms.parallel_dims import ParallelDims, log_mesh
from planning.memory import layer_attention_specs
from training.distributed import (
    init_process_group,
    pick_device,
    seed_everything,
    set_collective_timeout,
)
from training.inputs import SequenceSplit
from training.loop import (
    NonFiniteError,
    Run,
    StepError,
    TrainState,
    close_run,
    step_error,
    train_loop,
)
from training.loss import StepLoss, cross_entropy_sum
from training.optimizer import build_lr_scheduler, build_optimizer, no_decay_patterns
from training.preflight import param_counts
from training.step import StepSetup

logger = logging.getLogger("meshtrain")


def load_tokenizer(cfg: JobConfig):
    return build_tokenizer(cfg.model.tokenizer_path)


def meta_model(spec: ModelSpec, training, model_args) -> nn.Module:
    """The whole model on the meta device: shapes only, nothing allocated; its weights in
    the run's weight dtype (float64 in the float64 mode), before any parallelism sees them."""
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    return in_weight_dtype(model, training)


def build_model_parts(
    cfg, spec, parallel_dims, model_args, device, loss_fn, model=None
) -> ModelParts:
    """This rank's materialised, initialised model parts: `assemble_model` on the meta model,
    then materialise -> re-tie -> init. `model`: the whole meta model when the caller built it
    already (to count its parameters before the split and sharding)."""
    if model is None:
        model = meta_model(spec, cfg.training, model_args)
    built = assemble_model(model, spec, parallel_dims, AssemblyConfig.of(cfg), device, loss_fn)
    init_device = "cpu" if cfg.training.enable_cpu_offload else device
    for part in built.parts:
        materialize(part, cfg.debug.seed, device, init_device).train()
    return built


def forward_contexts(tp_loss_parallel: bool, autocast_dtype: torch.dtype | None, device_type: str):
    """(loss context, autocast context) factories for `StepSetup`: `loss_parallel()` for
    vocabulary-sharded logits under TP (the loss reduces across TP ranks itself; forward and
    backward), autocast when no FSDP/ZeRO casts the weights (forward and loss only)."""
    loss_context = loss_parallel if tp_loss_parallel else contextlib.nullcontext
    if autocast_dtype is None:
        return loss_context, contextlib.nullcontext
    return loss_context, functools.partial(torch.autocast, device_type, dtype=autocast_dtype)


def layout_forward_contexts(cfg: JobConfig, parallel_dims: ParallelDims, device_type: str):
    """`forward_contexts` for this layout: loss parallel under TP unless disabled; autocast to
    the compute dtype where no FSDP/ZeRO casts the weights (one GPU, TP- or PP-only layouts),
    which gives the same bf16 compute over fp32 weights."""
    compute_dtype = mixed_precision_dtypes(cfg.training, device_type)[0]
    weights = weight_dtype(cfg.training)  # float64 weights compute in float64: no autocast
    autocast = not parallel_dims.data_parallel_enabled and compute_dtype != weights
    return forward_contexts(
        parallel_dims.tp_enabled and not cfg.parallelism.disable_loss_parallel,
        compute_dtype if autocast else None,
        device_type,
    )


def start_runtime(cfg: JobConfig, parallel_dims: ParallelDims, local_rank: int) -> torch.device:
    """This rank's device, the process group (with gloo beside NCCL for CPU offload), the
    seeds and the device mesh: what every entry point that builds a layout starts with."""
    t = cfg.training
    device = pick_device(t.device, local_rank)
    init_process_group(
        device, parallel_dims.world_size, cfg.comm.init_timeout_seconds, t.enable_cpu_offload
    )
    seed_everything(cfg.debug.seed, cfg.debug.deterministic)
    parallel_dims.build_mesh(device.type)
    if cfg.compile.enable:
        key_compile_caches_to_rank(parallel_dims)
    return device


class BatchSizes(NamedTuple):
    global_batch: int  # sequences per optimizer step over all DP ranks
    accum_steps: int  # micro-batches per optimizer step
    tokens_per_rank_step: int  # tokens one rank sees per optimizer step


def batch_sizes(cfg: JobConfig, dp_degree: int, cp: int = 1) -> BatchSizes:
    """`cp`: each context-parallel rank holds 1/cp of every sequence's tokens."""
    t = cfg.training
    global_batch = (
        t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp_degree
    )
    accum_steps = global_batch // (t.local_batch_size * dp_degree)
    tokens = t.local_batch_size * (t.seq_len // cp) * accum_steps
    return BatchSizes(global_batch, accum_steps, tokens)


def step_loss_fn(cfg: JobConfig) -> StepLoss:
    """The loss `train_step` backpropagates: the (maybe compiled) token-loss sum over the
    step's global token count (see `StepLoss`)."""
    return StepLoss(maybe_compile_loss(cross_entropy_sum, cfg.compile))


def build_model(cfg, spec, parallel_dims, model_args, device, loss_fn, rank):
    """This rank's model parts (see `build_model_parts`), with the layout they make logged
    and written (layout.json, with the parameter counts); and the whole model's counts
    (`ParamCounts`) and each layer's attention spec (for the FLOPs per token), taken from the
    meta model before the pipeline split or sharding leaves a rank only its part."""
    model = meta_model(spec, cfg.training, model_args)
    counts = param_counts(spec, model)
    attention = layer_attention_specs(model)
    built = build_model_parts(cfg, spec, parallel_dims, model_args, device, loss_fn, model=model)
    layout = built_layout(built.parts, parallel_dims, built.schedule)
    layout["parameters"] = counts.as_dict()
    if rank == 0:
        write_layout(cfg.job.dump_folder, layout)
    logger.info(summarize(layout))
    return built, counts, attention


def model_rates(cfg, model_args, counts, device, batches, dp_degree, attention=None, local_rank=0):
    """(FLOPs per token, device peak FLOP/s) for the MFU, logged with the model's size and
    the batch; `attention`: each layer's spec (None: all plain causal). A CPU's cached peak
    is re-measured by local rank 0 alone."""
    t = cfg.training
    fpt = flops_per_token(
        counts.flops_params,
        model_args.n_layers,
        model_args.n_heads,
        model_args.head_dim,
        t.seq_len,
        attention,
    )
    compute_dtype = mixed_precision_dtypes(t, device.type)[0]
    peak, peak_src = device_peak_flops(
        device, compute_dtype, default_cache_dir(), refresh=local_rank == 0
    )
    logger.info(
        "model %s %s: %s parameters, %.2f GFLOP/token; global batch %d sequences "
        "(%d x %d DP ranks x %d accumulation steps); peak %.1f TFLOP/s (%s)",
        cfg.model.name,
        cfg.model.flavor,
        f"{counts.total:,}",
        fpt / 1e9,
        batches.global_batch,
        t.local_batch_size,
        dp_degree,
        batches.accum_steps,
        peak / 1e12,
        peak_src,
    )
    return fpt, peak


def warn_if_warmup_too_long(cfg: JobConfig) -> None:
    t = cfg.training
    if cfg.lr_scheduler.warmup_steps >= t.steps:
        logger.warning(
            "lr_scheduler.warmup_steps = %d is not below training.steps = %d: the LR never "
            "reaches optimizer.lr = %g in this run",
            cfg.lr_scheduler.warmup_steps,
            t.steps,
            cfg.optimizer.lr,
        )


def build_loaders(cfg: JobConfig, tokenizer, dp_rank: int, dp_degree: int, dp_group=None):
    """(training loader, validation loader or None) of this DP rank's slice; `dp_group` (the
    data-parallel ranks' process group) joins a sharded stream's cursors at a save."""
    from checkpoint.state import gather_objects

    t = cfg.training
    loader = functools.partial(
        build_dataloader,
        tokenizer=tokenizer,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        text_field=t.dataset_text_field,
        cache_dir=default_cache_dir(),
        documents=t.document_mask,  # boundaries from the sources' indexes, with each batch
    )
    train_loader = loader(
        dataset=t.dataset,
        dataset_path=t.dataset_path,
        split="train",
        shuffle_seed=t.shuffle_seed if t.shuffle else None,
        mixture=t.mixture,
        stream_shards=t.stream_shards,
        gather_cursors=None if dp_group is None else lambda c: gather_objects(c, dp_group),
    )
    if not cfg.validation.enable:
        return train_loader, None
    v = cfg.validation
    val_loader = loader(
        dataset=v.dataset or t.dataset,
        dataset_path=v.dataset_path or t.dataset_path,
        split="validation",
        infinite=False,
    )
    return train_loader, val_loader


def build_source_validation(cfg: JobConfig, tokenizer, dp_rank: int, dp_degree: int) -> dict:
    """validation.per_source: one finite loader per mixture source, by metric label."""
    if not cfg.validation.enable:
        return {}
    t = cfg.training
    loaders = {}
    for i, entry in enumerate(cfg.validation.per_source):
        kind, _, path = entry.partition(":")
        loaders[f"mix{i}"] = build_dataloader(
            dataset=kind, dataset_path=path, tokenizer=tokenizer, seq_len=t.seq_len,
            local_batch_size=t.local_batch_size, dp_rank=dp_rank, dp_degree=dp_degree,
            split="validation", text_field=t.dataset_text_field, cache_dir=default_cache_dir(),
            infinite=False, documents=t.document_mask,
        )  # fmt: skip
    return loaders


def build_optimizers(cfg: JobConfig, model_parts: list[nn.Module], device_type: str):
    """(optimizer, LR scheduler) of the run: `[optimizer]` over every local model part, the
    `[lr_scheduler]` schedule over `training.steps` optimizer steps."""
    spec = get_model_spec(cfg.model.name)
    optimizer = build_optimizer(
        model_parts, cfg.optimizer, device_type, no_decay_patterns(cfg), spec=spec
    )
    if hasattr(optimizer, "describe"):
        logger.info("optimizer: %s", optimizer.describe())
    return optimizer, build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)


def build_checkpointer(cfg, parallel_dims, model_parts, optimizer, lr_scheduler, loader, state):
    """The checkpoint manager, with the latest checkpoint (if any) loaded; None if disabled."""
    if not cfg.checkpoint.enable:
        return None
    from checkpoint.manager import CheckpointManager

    checkpointer = CheckpointManager(
        cfg,
        model_parts=model_parts,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dataloader=loader,
        train_state=state,
        parallel_dims=parallel_dims,
    )
    checkpointer.load()
    return checkpointer


def sequence_split(cfg: JobConfig, parallel_dims: ParallelDims, model_args) -> SequenceSplit:
    """This rank's CP shard of the sequences, whether attention stays within documents,
    whether stages need the positions given (pipeline parallelism), and the later labels the
    model's multi-token prediction needs."""
    cp_rank, cp = parallel_dims.coordinate("cp")
    pp = parallel_dims.coordinate("pp")[1]
    depth = getattr(model_args, "mtp_depth", 0)
    return SequenceSplit(cp_rank, cp, cfg.training.document_mask, pp > 1, depth)


def multi_token_prediction(model_args, model_parts: list[nn.Module], loss_fn: StepLoss) -> None:
    """A model's multi-token-prediction modules (models/mtp.py) train on the step loss, as the
    main output does: every depth's token-loss sum over the step's global token count, their
    mean weighted by `mtp_loss_weight`."""
    if getattr(model_args, "mtp_depth", 0):
        mtp.set_loss(model_parts, loss_fn, model_args.mtp_loss_weight)


def build_step_setup(cfg, parallel_dims, device, built, loss_fn, split):
    """`StepSetup` for the model `build_model_parts` built (`built`)."""
    loss_context, autocast = layout_forward_contexts(cfg, parallel_dims, device.type)
    return StepSetup(
        split=split,
        model_parts=built.parts,
        loss_fn=loss_fn,
        pp_schedule=built.schedule,
        pp_first_stage=built.has_first_stage,
        pp_last_stage=built.has_last_stage,
        loss_context=loss_context,
        autocast=autocast,
        tied=built.tied,
    )


def build_observers(cfg: JobConfig, rank: int, device: torch.device, start_step: int):
    """(metrics logger, profiler, memory snapshot, phase timer); the profiler's summaries go
    to the metrics as `profile` records."""
    metrics = MetricsLogger(
        cfg.job.dump_folder,
        rank,
        enabled=rank == 0,
        enable_tensorboard=cfg.metrics.enable_tensorboard,
        tb_folder=cfg.metrics.save_tb_folder,
    )
    profiler = Profiler(
        cfg.profiling,
        cfg.job.dump_folder,
        rank,
        device.type,
        start_step=start_step,
        on_summary=lambda step, summary: metrics.log(step, summary, kind="profile"),
    )
    snapshot = MemorySnapshot(cfg.profiling, cfg.job.dump_folder, rank, device.type)
    return metrics, profiler, snapshot, PhaseTimer(device)


def scaled_routing(spec: ModelSpec, model_parts: list[nn.Module], tokens_per_rank_step: int):
    """The family's routing hooks (None without experts), their layers' own losses scaled as
    the step loss is: they are token sums, divided by this rank's tokens per step."""
    routing = spec.routing
    if routing is not None:
        routing.set_loss_scale(model_parts, 1.0 / tokens_per_rank_step)
    return routing


def data_parallel_coordinates(parallel_dims: ParallelDims):
    """(this rank's DP rank, the DP degree, the DP ranks' process group or None at degree 1)."""
    dp_rank, dp_degree = parallel_dims.coordinate("dp")
    dp_mesh = parallel_dims.dim("dp")
    return (
        dp_rank,
        dp_degree,
        dp_mesh.get_group() if dp_mesh is not None and dp_degree > 1 else None,
    )


def build_run(cfg: JobConfig, parallel_dims: ParallelDims, *, rank: int, local_rank: int) -> Run:
    """Runtime, data, model, optimizer, schedule, checkpoint (resumed), step setup and
    observers, in that order."""
    t = cfg.training
    device = start_runtime(cfg, parallel_dims, local_rank)
    log_mesh(parallel_dims)
    dp_rank, dp_degree, dp_group = data_parallel_coordinates(parallel_dims)
    tokenizer = load_tokenizer(cfg)
    model_args = model_args_for(cfg, t.seq_len, tokenizer.vocab_size)
    batches = batch_sizes(cfg, dp_degree, parallel_dims.cp)
    step_loss = step_loss_fn(cfg)
    rss_before_model = process_rss_gib() if device.type == "cpu" else None
    spec = get_model_spec(cfg.model.name)  # the family: looked up once, passed on
    built, counts, attention = build_model(
        cfg, spec, parallel_dims, model_args, device, step_loss, rank
    )
    fpt, peak = model_rates(
        cfg, model_args, counts, device, batches, dp_degree, attention, local_rank
    )
    warn_if_warmup_too_long(cfg)
    train_loader, val_loader = build_loaders(cfg, tokenizer, dp_rank, dp_degree, dp_group)
    model_parts = built.parts
    optimizer, lr_scheduler = build_optimizers(cfg, model_parts, device.type)
    state = TrainState()
    checkpointer = build_checkpointer(
        cfg, parallel_dims, model_parts, optimizer, lr_scheduler, train_loader, state
    )
    split = sequence_split(cfg, parallel_dims, model_args)
    setup = build_step_setup(cfg, parallel_dims, device, built, step_loss, split)
    multi_token_prediction(model_args, model_parts, step_loss)
    routing = scaled_routing(spec, model_parts, batches.tokens_per_rank_step)
    set_collective_timeout(cfg.comm.train_timeout_seconds)
    metrics, profiler, snapshot, phases = build_observers(cfg, rank, device, state.step)
    return Run(
        cfg=cfg,
        parallel_dims=parallel_dims,
        rank=rank,
        device=device,
        setup=setup,
        accum_steps=batches.accum_steps,
        tokens_per_step=batches.global_batch * t.seq_len,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        data_iter=iter(train_loader),
        train_loader=train_loader,
        val_loader=val_loader,
        val_sources=build_source_validation(cfg, tokenizer, dp_rank, dp_degree),
        checkpointer=checkpointer,
        state=state,
        loss_replicas=parallel_dims.world_size // parallel_dims.pp,  # ranks per loss x DP
        flops_per_token=fpt,
        peak_flops=peak,
        metrics=metrics,
        profiler=profiler,
        snapshot=snapshot,
        phases=phases,
        rss_before_model=rss_before_model,
        routing=routing,
    )


def run_training(
    cfg: JobConfig, parallel_dims: ParallelDims, *, rank: int, local_rank: int, stop
) -> TrainState:
    """Builds the run and trains it; any failure inside the loop comes out as a `StepError`
    (or `NonFiniteError`), after the teardown. `stop`: training.launch's StopFlag."""
    run = build_run(cfg, parallel_dims, rank=rank, local_rank=local_rank)
    try:
        train_loop(run, stop)
    except (NonFiniteError, StepError):
        raise
    except Exception as e:
        raise step_error(run, e) from e
    finally:
        close_run(run, failed=sys.exc_info()[1] is not None)
    logger.info("done: %d steps, %s tokens", run.state.step, f"{run.state.tokens_seen:,}")
    return run.state
