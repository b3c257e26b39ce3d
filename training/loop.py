"""The training loop: what one run holds (`Run`, built by `training.trainer.build_run`), the
named pieces of a step, the loop that calls them and the teardown after it."""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from job_config import JobConfig
from metrics import MetricsLogger, peak_memory_gib, reset_peak_memory, throughput
from metrics.memory_report import memory_report
from metrics.profiling import MemorySnapshot, PhaseTimer, Profiler
from models import mtp
from parallelisms.parallel_dims import ParallelDims
from training.inputs import sequence_inputs
from training.step import StepSetup, clip_grad_norm_, global_mean, train_step
from training.validate import evaluate

logger = logging.getLogger("meshtrain")


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the run stops without saving."""


class StepError(RuntimeError):
    """Any failure inside the training loop, re-raised with the rank and step it happened at
    (a collective timeout then says which rank gave up at which step)."""


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


@dataclass
class LogWindow:
    """The steps since the last logged one: how many, and their wall and data-loading time."""

    steps: int = 0
    time: float = 0.0
    data: float = 0.0

    def add(self, step_time: float, data_time: float) -> None:
        self.steps += 1
        self.time += step_time
        self.data += data_time


class NonFiniteWatch:
    """The first step whose loss or gradient norm was not finite, kept on the device (no host
    sync per step) and agreed by all ranks only when checked."""

    def __init__(self, device: torch.device):
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)

    def note(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, has_loss: bool):
        """`has_loss`: this rank computes the loss (pipeline stages before the last do not)."""
        bad = ~torch.isfinite(grad_norm) | (~torch.isfinite(loss) if has_loss else False)
        self.first_bad = torch.where(bad & (self.first_bad < 0), step, self.first_bad)

    def check(self, consequence: str) -> None:
        """Raises `NonFiniteError` ending in `consequence` if any rank saw one; a collective on
        all ranks. Every rank sees the same global loss and gradient norm, so their first
        steps agree."""
        value = self.first_bad.clone().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        bad_step = int(value.item())
        if bad_step >= 0:
            raise NonFiniteError(
                f"non-finite loss or gradient norm at step {bad_step}{consequence}"
            )


@dataclass
class Run:
    """Everything the loop uses; `training.trainer.build_run` builds it once."""

    cfg: JobConfig
    parallel_dims: ParallelDims
    rank: int
    device: torch.device
    setup: StepSetup  # model parts, loss, pipeline schedule, forward contexts
    accum_steps: int  # micro-batches per optimizer step
    tokens_per_step: int  # over all DP ranks: global batch x seq_len
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    data_iter: Iterator
    val_loader: object | None
    checkpointer: object | None  # checkpoint.manager.CheckpointManager
    state: TrainState
    loss_replicas: int  # ranks holding each loss value's copy, for the logged global mean
    flops_per_token: float
    peak_flops: float
    metrics: MetricsLogger
    profiler: Profiler
    snapshot: MemorySnapshot
    phases: PhaseTimer
    rss_before_model: float | None  # CPU: the process's peak RSS before the model existed
    routing: object | None = None  # models.RoutingHooks of an MoE family
    train_loader: object | None = None  # data.dataloader.DPDataLoader (data_iter's loader)
    val_sources: dict | None = None  # validation.per_source: metric label -> loader
    # derived from the above:
    params: list[torch.Tensor] = field(init=False)  # this rank's, for the gradient-norm clip
    tied_copies: list[torch.Tensor] = field(init=False)  # among params: clipped, not counted
    pp_group: dist.ProcessGroup | None = field(init=False)  # the norm's sum over the stages
    first_step: int = field(init=False)  # after a resume too; its time includes compilation
    non_finite: NonFiniteWatch = field(init=False)
    window: LogWindow = field(init=False, default_factory=LogWindow)
    # the last step's multi-token-prediction loss, this rank's share (models/mtp.py)
    mtp_loss: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.params = [p for part in self.setup.model_parts for p in part.parameters()]
        self.tied_copies = self.setup.tied.copies if self.setup.tied is not None else []
        dims = self.parallel_dims
        self.pp_group = dims.dim("pp").get_group() if dims.pp_enabled else None
        self.first_step = self.state.step + 1
        self.non_finite = NonFiniteWatch(self.device)


def maybe_inject_failure(cfg: JobConfig, step: int, rank: int, world_size: int) -> None:
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


def next_microbatches(run: Run) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
    """This rank's (inputs, labels, model keyword arguments) for every micro-step of the
    optimizer step, on the device: its CP shard of the sequences, and the attention
    coordinates (see training.inputs.sequence_inputs)."""
    micro = []
    for _ in range(run.accum_steps):
        inputs, labels, *documents = (
            t.to(run.device, non_blocking=True) for t in next(run.data_iter)
        )
        micro.append(sequence_inputs(run.setup.split, inputs, labels, *documents))
    return micro


def forward_backward(run: Run, micro: list[tuple]) -> torch.Tensor:
    """`train_step`, timed; an out-of-memory error first dumps the memory snapshot."""
    run.phases.start()
    try:
        loss = train_step(run.setup, micro)
    except torch.OutOfMemoryError:
        run.snapshot.on_oom(run.state.step)
        raise
    run.mtp_loss = mtp.take_logged_losses(run.setup.model_parts)
    run.phases.mark("forward_backward")
    return loss


def log_memory(run: Run) -> None:
    """What the model, gradients and optimizer state hold after the first step."""
    held = memory_report(run.setup.model_parts, run.optimizer)
    logger.info("memory after step %d: %s", run.state.step, held)
    record = held.as_metrics()
    if run.rss_before_model is not None:  # CPU: peak RSS minus this = the run's own
        record["rss_before_model_gib"] = run.rss_before_model
    run.metrics.log(run.state.step, record, kind="memory")


def optimizer_step(run: Run) -> tuple[torch.Tensor, float]:
    """Clip, step, advance the LR schedule and the profilers; (gradient norm, the step's LR)."""
    grad_norm = clip_grad_norm_(
        run.params, run.cfg.training.max_norm, run.pp_group, run.tied_copies
    )
    run.optimizer.step()  # waits first for an async save's copy (the checkpointer's hook)
    if run.routing is not None:  # MoE: the step's expert loads, the balancing bias
        run.routing.after_optimizer_step(run.setup.model_parts)
    if run.state.step == run.first_step:  # grads and optimizer state both exist only now
        log_memory(run)
    step_lr = run.lr_scheduler.get_last_lr()[0]  # the LR this step used
    run.lr_scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.phases.mark("optimizer")
    run.profiler.step()
    run.snapshot.step(run.state.step)
    return grad_norm, step_lr


def is_log_step(run: Run) -> bool:
    step = run.state.step
    return step % run.cfg.metrics.log_freq == 0 or step in (run.first_step, run.cfg.training.steps)


def log_window(run: Run, loss: torch.Tensor, grad_norm: torch.Tensor, step_lr: float) -> dict:
    """The metrics record of the steps since the last log step (a collective: the loss's
    global mean); starts the next window. Returns the record."""
    window, step = run.window, run.state.step
    global_loss = global_mean(loss, run.loss_replicas)
    device_tokens = run.tokens_per_step / run.parallel_dims.world_size * window.steps
    rates = throughput(int(device_tokens), window.time, run.flops_per_token, run.peak_flops)
    record = {
        "loss": global_loss,
        "grad_norm": grad_norm.item(),
        "lr": step_lr,
        **(
            {}
            if run.mtp_loss is None
            else {"mtp_loss": global_mean(run.mtp_loss, run.loss_replicas)}
        ),
        **rates,
        "memory_gib": peak_memory_gib(run.device),
        "step_time_s": window.time / window.steps,
        "data_time_s": window.data / window.steps,
        **{f"{k}_time_s": v for k, v in run.phases.pop().items()},
        "tokens_seen": run.state.tokens_seen,
        **getattr(getattr(run, "train_loader", None), "source_tokens", dict)(),  # a mixture
    }
    if run.cfg.compile.enable and step == run.first_step:
        record["compile_time_s"] = record["step_time_s"]  # not a steady-state step
    run.metrics.log(step, record)
    run.window = LogWindow()
    return record


def log_router(run: Run) -> None:
    """The MoE layers' statistics of the step (`kind: "router"`), from every pipeline stage,
    and a warning for experts that went without tokens for `moe.idle_warn_steps`."""
    per_layer = run.routing.layer_stats(run.setup.model_parts)
    if run.pp_group is not None:
        stages = [None] * dist.get_world_size(run.pp_group)
        dist.all_gather_object(stages, per_layer, group=run.pp_group)
        per_layer = {k: v for stage in stages for k, v in stage.items()}
    record, warnings = run.routing.summarize(per_layer, run.cfg.moe.idle_warn_steps)
    run.metrics.log(run.state.step, record, kind="router")
    for warning in warnings if run.rank == 0 else ():
        logger.warning(warning)


def maybe_validate(run: Run) -> None:
    step = run.state.step
    if run.val_loader is None or step % run.cfg.validation.freq != 0:
        return
    # validation steps of whole global batches, read as a training step reads one
    evaluate_on = functools.partial(
        evaluate, run.setup, steps=run.cfg.validation.steps, device=run.device,
        micro_batches=run.accum_steps,
    )  # fmt: skip
    val_loss = evaluate_on(run.val_loader)
    record = {"loss": val_loss, "perplexity": math.exp(min(val_loss, 50.0))}
    for label, loader in (run.val_sources or {}).items():  # each mixture source's held-out loss
        record[f"loss_{label}"] = evaluate_on(loader)
    run.metrics.log(step, record, kind="validation")


def maybe_checkpoint(run: Run) -> None:
    """A save when one is due, never of a run that went non-finite."""
    if run.checkpointer is None:
        return
    if run.checkpointer.due(run.state.step):
        run.non_finite.check("; not saving a checkpoint.")
    run.checkpointer.maybe_save(run.state.step)


def stop_requested(run: Run, stop) -> bool:
    """Whether all ranks agree to stop (SIGTERM, SLURM preemption; a collective); then a
    checkpoint at this step, unless its regular save already wrote one."""
    if not stop.agreed(run.device):
        return False
    logger.info("stopping at step %d on request", run.state.step)
    if run.checkpointer is not None and not run.checkpointer.due(run.state.step):
        run.checkpointer.save(run.state.step)
    return True


def train_loop(run: Run, stop) -> None:
    """Steps until `training.steps` or an agreed stop request; `stop`: training.launch's StopFlag."""
    cfg, state = run.cfg, run.state
    reset_peak_memory(run.device)
    logger.info("training from step %d to %d", state.step + 1, cfg.training.steps)
    while state.step < cfg.training.steps:
        state.step += 1
        t0 = time.perf_counter()
        micro = next_microbatches(run)
        t_data = time.perf_counter() - t0
        maybe_inject_failure(cfg, state.step, run.rank, run.parallel_dims.world_size)
        loss = forward_backward(run, micro)
        grad_norm, step_lr = optimizer_step(run)
        run.non_finite.note(state.step, loss, grad_norm, run.setup.pp_last_stage)
        state.tokens_seen += run.tokens_per_step
        log_now = is_log_step(run)
        if log_now and run.device.type == "cuda":  # queued kernels belong to this window
            torch.cuda.synchronize(run.device)
        run.window.add(time.perf_counter() - t0, t_data)
        if log_now:
            record = log_window(run, loss, grad_norm, step_lr)
            if run.routing is not None:
                log_router(run)
            run.non_finite.check(
                f" (loss {record['loss']}, grad_norm {record['grad_norm']}); stopping without "
                "saving. Lower optimizer.lr, check the data, or raise warmup."
            )
        maybe_validate(run)
        maybe_checkpoint(run)
        if log_now and stop_requested(run, stop):
            break


def step_error(run: Run, error: Exception) -> StepError:
    """`error` as a `StepError` naming the rank and step (and the timeout, if it was one)."""
    message = f"rank {run.rank} failed at step {run.state.step}: {type(error).__name__}: {error}"
    text = str(error).lower()
    if "timeout" in text or "timed out" in text:
        message += f" (comm.train_timeout_seconds = {run.cfg.comm.train_timeout_seconds})"
    return StepError(message)


def close_run(run: Run, failed: bool) -> None:
    """Profilers, checkpointer (its async save finishes) and metrics files. After a failure
    (`failed`) the error the user sees stays that one: a save cut short by it may fail to
    close too, which is then only logged."""
    run.profiler.close()
    run.snapshot.close()
    if run.checkpointer is not None:
        if not failed:
            run.checkpointer.close()
        else:
            try:
                run.checkpointer.close()
            except Exception as close_error:  # noqa: BLE001
                logger.error("checkpoint: closing after the error also failed: %s", close_error)
    run.metrics.close()
