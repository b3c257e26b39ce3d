"""Builds a run from a validated config and drives the training loop."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from data.dataloader import build_dataloader
from data.sample_corpus import default_cache_dir
from data.tokenizer import build_tokenizer
from job_config import JobConfig
from metrics import MetricsLogger, count_params, device_peak_flops, flops_per_token, throughput
from metrics.memory import peak_memory_gib, process_rss_gib, reset_peak_memory
from models import get_model_spec, model_args_for
from parallelisms.compile import maybe_compile_loss
from parallelisms.init_weights import materialize
from parallelisms.layout_record import built_layout, summarize, write_layout
from parallelisms.memory_report import memory_report
from parallelisms.mixed_precision import mixed_precision_dtypes
from parallelisms.parallel_dims import ParallelDims, log_mesh
from training.distributed import (
    init_process_group,
    pick_device,
    seed_everything,
    set_collective_timeout,
)
from training.loss import cross_entropy_sum
from training.optimizer import build_lr_scheduler, build_optimizer
from training.profiling import MemorySnapshot, PhaseTimer, Profiler
from training.step import StepSetup, clip_grad_norm_, global_mean, train_step
from training.validate import evaluate

logger = logging.getLogger("meshtrain")


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the run stops without saving."""


class StepError(RuntimeError):
    """Any failure inside the training loop, re-raised with the rank and step it happened at
    (a collective timeout then says which rank gave up at which step)."""


def _maybe_inject_failure(cfg: JobConfig, step: int, rank: int, world_size: int) -> None:
    """`debug.fail_at_step` / `debug.hang_at_step`: the last rank fails, or stops answering,
    at that step on torchrun's first attempt."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank != world_size - 1 or attempt != 0:
        return
    if cfg.debug.hang_at_step == step:
        logger.warning("debug.hang_at_step: rank %d hangs at step %d", rank, step)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(1))  # torchrun's teardown
        time.sleep(3600)
    if cfg.debug.fail_at_step == step:
        raise RuntimeError(
            f"debug.fail_at_step = {step}: injected failure (first attempt only; "
            "TORCHELASTIC_RESTART_COUNT = 0)"
        )


def _save_on_stop(checkpointer, step: int) -> None:
    """A checkpoint at the step where a stop request (SIGTERM, SLURM preemption) was agreed,
    unless this step's regular save already wrote one."""
    if checkpointer is not None and not checkpointer.due(step):
        checkpointer.save(step)


@dataclass
class TrainState:
    """Progress that a checkpoint must carry besides model/optimizer/data state."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])


def load_tokenizer(cfg: JobConfig):
    return build_tokenizer(cfg.model.tokenizer_path)


def build_model_parts(cfg, parallel_dims, model_args, device, loss_fn):
    """Model on meta -> (pipeline split) -> parallelize -> materialise -> re-tie -> init.

    Returns (model_parts, pp_schedule, has_first_stage, has_last_stage).
    """
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    if parallel_dims.pp_enabled:
        model_parts, schedule, first, last = spec.pipeline_fn(
            model, parallel_dims, cfg, device, loss_fn
        )
    else:
        model_parts = [spec.parallelize_fn(model, parallel_dims, cfg, device.type)]
        schedule, first, last = None, True, True
    init_device = "cpu" if cfg.training.enable_cpu_offload else device
    for part in model_parts:
        materialize(part, cfg.debug.seed, device, init_device).train()
    return model_parts, schedule, first, last


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
    autocast = not parallel_dims.dp_enabled and compute_dtype != torch.float32
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
    return device


def run_training(
    cfg: JobConfig, parallel_dims: ParallelDims, *, rank: int, local_rank: int, stop
) -> TrainState:
    t = cfg.training
    device = start_runtime(cfg, parallel_dims, local_rank)
    log_mesh(parallel_dims)
    dp_rank, dp_degree = parallel_dims.coordinate("dp")

    tokenizer = load_tokenizer(cfg)
    model_args = model_args_for(cfg.model, t.seq_len, tokenizer.vocab_size)
    global_batch = (
        t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp_degree
    )
    accum_steps = global_batch // (t.local_batch_size * dp_degree)
    tokens_per_rank_step = t.local_batch_size * t.seq_len * accum_steps

    token_loss_sum = maybe_compile_loss(cross_entropy_sum, cfg.compile)

    def step_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, labels) / tokens_per_rank_step

    rss_before_model = process_rss_gib() if device.type == "cpu" else None
    model_parts, schedule, first, last = build_model_parts(
        cfg, parallel_dims, model_args, device, step_loss
    )
    layout = built_layout(model_parts, parallel_dims, schedule)
    if rank == 0:
        write_layout(cfg.job.dump_folder, layout)
    logger.info(summarize(layout))
    with torch.device("meta"):  # the whole model, also when this rank holds one PP stage
        whole = get_model_spec(cfg.model.name).model_cls(model_args)
    n_params, n_no_emb = count_params(whole), count_params(whole, exclude_embedding=True)
    fpt = flops_per_token(
        n_no_emb, model_args.n_layers, model_args.n_heads, model_args.head_dim, t.seq_len
    )
    compute_dtype = mixed_precision_dtypes(t, device.type)[0]
    peak, peak_src = device_peak_flops(device, compute_dtype, default_cache_dir())
    logger.info(
        "model %s %s: %s parameters, %.2f GFLOP/token; global batch %d sequences "
        "(%d x %d DP ranks x %d accumulation steps); peak %.1f TFLOP/s (%s)",
        cfg.model.name,
        cfg.model.flavor,
        f"{n_params:,}",
        fpt / 1e9,
        global_batch,
        t.local_batch_size,
        dp_degree,
        accum_steps,
        peak / 1e12,
        peak_src,
    )

    if cfg.lr_scheduler.warmup_steps >= t.steps:
        logger.warning(
            "lr_scheduler.warmup_steps = %d is not below training.steps = %d: the LR never "
            "reaches optimizer.lr = %g in this run",
            cfg.lr_scheduler.warmup_steps,
            t.steps,
            cfg.optimizer.lr,
        )

    loader = functools.partial(
        build_dataloader,
        tokenizer=tokenizer,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        text_field=t.dataset_text_field,
        cache_dir=default_cache_dir(),
    )
    train_loader = loader(dataset=t.dataset, dataset_path=t.dataset_path, split="train")
    val_loader = None
    if cfg.validation.enable:
        v = cfg.validation
        val_loader = loader(
            dataset=v.dataset or t.dataset,
            dataset_path=v.dataset_path or t.dataset_path,
            split="validation",
            infinite=False,
        )

    optimizer = build_optimizer(model_parts, cfg.optimizer, device.type)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, t.steps)
    state = TrainState()
    checkpointer = None
    if cfg.checkpoint.enable:
        from checkpoint.manager import CheckpointManager

        checkpointer = CheckpointManager(
            cfg,
            model_parts=model_parts,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dataloader=train_loader,
            train_state=state,
            parallel_dims=parallel_dims,
        )
        checkpointer.load()

    loss_context, autocast = layout_forward_contexts(cfg, parallel_dims, device.type)
    setup = StepSetup(
        model_parts=model_parts,
        loss_fn=step_loss,
        tokens_per_rank_step=tokens_per_rank_step,
        pp_schedule=schedule,
        pp_first_stage=first,
        pp_last_stage=last,
        loss_context=loss_context,
        autocast=autocast,
    )
    params = [p for part in model_parts for p in part.parameters()]
    pp_group = parallel_dims.dim("pp").get_group() if parallel_dims.pp_enabled else None
    loss_replicas = parallel_dims.world_size // parallel_dims.pp  # ranks per loss value x DP
    metrics = MetricsLogger(
        cfg.job.dump_folder,
        rank,
        enabled=rank == 0,
        enable_tensorboard=cfg.metrics.enable_tensorboard,
        tb_folder=cfg.metrics.save_tb_folder,
    )
    set_collective_timeout(cfg.comm.train_timeout_seconds)
    profiler = Profiler(
        cfg.profiling,
        cfg.job.dump_folder,
        rank,
        device.type,
        start_step=state.step,
        on_summary=lambda step, summary: metrics.log(step, summary, kind="profile"),
    )
    snapshot = MemorySnapshot(cfg.profiling, cfg.job.dump_folder, rank, device.type)
    phases = PhaseTimer(device)
    data_iter = iter(train_loader)
    first_bad = torch.full((), -1, dtype=torch.long, device=device)
    tokens_per_device_step = global_batch * t.seq_len / parallel_dims.world_size
    window = {"steps": 0, "time": 0.0, "data": 0.0}
    reset_peak_memory(device)
    logger.info("training from step %d to %d", state.step + 1, t.steps)
    first_step = state.step + 1  # its time includes compilation when compile is on
    try:
        while state.step < t.steps:
            state.step += 1
            t0 = time.perf_counter()
            micro = []
            for _ in range(accum_steps):
                inputs, labels = next(data_iter)
                micro.append(
                    (inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True))
                )
            t_data = time.perf_counter() - t0
            _maybe_inject_failure(cfg, state.step, rank, parallel_dims.world_size)
            phases.start()
            try:
                loss = train_step(setup, micro)
            except torch.OutOfMemoryError:
                snapshot.on_oom(state.step)
                raise
            phases.mark("forward_backward")
            grad_norm = clip_grad_norm_(params, t.max_norm, pp_group)
            optimizer.step()  # waits first for an async save's copy (the checkpointer's hook)
            if state.step == first_step:  # grads and optimizer state both exist only now
                held = memory_report(model_parts, optimizer)
                logger.info("memory after step %d: %s", state.step, held)
                record = held.as_metrics()
                if rss_before_model is not None:  # CPU: peak RSS minus this = the run's own
                    record["rss_before_model_gib"] = rss_before_model
                metrics.log(state.step, record, kind="memory")
            step_lr = lr_scheduler.get_last_lr()[0]  # the LR this step used
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            phases.mark("optimizer")
            profiler.step()
            snapshot.step(state.step)
            bad = ~torch.isfinite(grad_norm) | (~torch.isfinite(loss) if last else False)
            first_bad = torch.where(bad & (first_bad < 0), state.step, first_bad)
            state.tokens_seen += global_batch * t.seq_len
            log_now = state.step % cfg.metrics.log_freq == 0 or state.step in (first_step, t.steps)
            if log_now and device.type == "cuda":  # queued kernels belong to this window
                torch.cuda.synchronize(device)
            window["steps"] += 1
            window["time"] += time.perf_counter() - t0
            window["data"] += t_data

            if log_now:
                global_loss = global_mean(loss, loss_replicas)
                rates = throughput(
                    int(tokens_per_device_step * window["steps"]), window["time"], fpt, peak
                )
                record = {
                    "loss": global_loss,
                    "grad_norm": grad_norm.item(),
                    "lr": step_lr,
                    **rates,
                    "memory_gib": peak_memory_gib(device),
                    "step_time_s": window["time"] / window["steps"],
                    "data_time_s": window["data"] / window["steps"],
                    **{f"{k}_time_s": v for k, v in phases.pop().items()},
                    "tokens_seen": state.tokens_seen,
                }
                if cfg.compile.enable and state.step == first_step:
                    record["compile_time_s"] = record["step_time_s"]  # not a steady-state step
                metrics.log(state.step, record)
                window = {"steps": 0, "time": 0.0, "data": 0.0}
                bad_step = _first_bad_step(first_bad)
                if bad_step >= 0:
                    raise NonFiniteError(
                        f"non-finite loss or gradient norm at step {bad_step} (loss "
                        f"{global_loss}, grad_norm {record['grad_norm']}); stopping without "
                        "saving. Lower optimizer.lr, check the data, or raise warmup."
                    )
            if val_loader is not None and state.step % cfg.validation.freq == 0:
                val_loss = evaluate(setup, val_loader, cfg.validation.steps, device)
                metrics.log(
                    state.step,
                    {"loss": val_loss, "perplexity": math.exp(min(val_loss, 50.0))},
                    kind="validation",
                )
            if checkpointer is not None:
                bad_step = _first_bad_step(first_bad) if checkpointer.due(state.step) else -1
                if bad_step >= 0:
                    raise NonFiniteError(
                        f"non-finite loss or gradient norm at step {bad_step}; "
                        "not saving a checkpoint."
                    )
                checkpointer.maybe_save(state.step)
            if log_now and stop.agreed(device):
                logger.info("stopping at step %d on request", state.step)
                _save_on_stop(checkpointer, state.step)
                break
    except (NonFiniteError, StepError):
        raise
    except Exception as e:
        raise StepError(
            f"rank {rank} failed at step {state.step}: {type(e).__name__}: {e}"
            + (
                f" (comm.train_timeout_seconds = {cfg.comm.train_timeout_seconds})"
                if "timeout" in str(e).lower() or "timed out" in str(e).lower()
                else ""
            )
        ) from e
    finally:
        profiler.close()
        snapshot.close()
        if checkpointer is not None:
            if sys.exc_info()[1] is None:
                checkpointer.close()
            else:  # keep the original error: a save cut short by it may fail to close too
                try:
                    checkpointer.close()
                except Exception as close_error:  # noqa: BLE001
                    logger.error("checkpoint: closing after the error also failed: %s", close_error)
        metrics.close()
    logger.info("done: %d steps, %s tokens", state.step, f"{state.tokens_seen:,}")
    return state


def _first_bad_step(first_bad: torch.Tensor) -> int:
    """The first non-finite step (-1 if none), agreed by all ranks; a collective on all ranks.
    Every rank sees the same global loss and gradient norm, so their first steps agree."""
    value = first_bad.clone().reshape(1)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())
