"""From a command line to a running job: the checks (`training.preflight`), this process's
place in the job, the logging, the signals and the training; `train.py` is its command line.

Order of construction: config -> parallel dims -> process group + mesh -> tokenizer + data ->
model on meta -> (pipeline split) -> parallelize -> materialise + init -> optimizer + LR
schedule -> checkpoint (resume) -> loop. The loop calls one step function whatever the layout.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint import CheckpointError
from job_config import ConfigError, JobConfig, config_notes, config_to_toml, parse_args
from job_config.checks import validate
from parallelisms.parallel_dims import ParallelDims, ParallelismError
from training.distributed import LaunchError, launch_env, pick_device, record_error
from training.optimizer import no_decay_patterns
from training.preflight import check_config, check_data_files, dry_run, import_custom_families

logger = logging.getLogger("meshtrain")


def setup_logging(dump_folder: str, rank: int) -> None:
    """Rank 0 logs to the console, the other ranks their errors (stderr); every rank logs to
    <dump_folder>/logs/rank_<r>.log."""
    logger.setLevel(logging.INFO)
    logger.handlers.clear()
    logger.propagate = False
    fmt = logging.Formatter("%(asctime)s [rank%(rank)s] %(message)s", "%H:%M:%S")
    old_factory = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = old_factory(*args, **kwargs)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
    log_dir = Path(dump_folder) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(log_dir / f"rank_{rank}.log")
    file_handler.setFormatter(fmt)
    logger.addHandler(file_handler)
    if rank == 0 or os.environ.get("LOG_ALL_RANKS") == "1":
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(fmt)
        logger.addHandler(console)
    else:
        # The other ranks' errors reach the console too: a rank that fails first is then
        # seen with its own error, not only as its peers' "Connection closed by peer".
        errors = logging.StreamHandler(sys.stderr)
        errors.setLevel(logging.ERROR)
        errors.setFormatter(fmt)
        logger.addHandler(errors)


@dataclass
class StopFlag:
    """Set by SIGINT/SIGTERM; the loop stops at the next step where all ranks agree."""

    requested: bool = False

    def install(self) -> None:
        def handler(signum, frame):
            if self.requested:  # second signal: stop now
                raise KeyboardInterrupt
            self.requested = True
            logger.info("signal %d received: stopping after this step", signum)

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
        # SLURM's advance warning before the time limit (#SBATCH --signal=USR1@120): stop,
        # save a checkpoint and let the batch script requeue the job.
        signal.signal(signal.SIGUSR1, handler)

    def agreed(self, device: torch.device) -> bool:
        if not torch.distributed.is_initialized():
            return self.requested
        flag = torch.tensor([int(self.requested)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


@dataclass
class Launch:
    """A checked config and this process's place in the job: what training starts from."""

    cfg: JobConfig
    parallel_dims: ParallelDims
    rank: int
    local_rank: int


def prepare(argv: list[str]) -> Launch | None:
    """Parses and checks the command line and the launch; None when it asked for a one-process
    command (dry run, seed checkpoint), which has then run."""
    cfg = parse_args(argv, check=False)  # checked below, with the layout: one message
    import_custom_families(cfg.job.custom_import)  # before any check: it may register the family
    if cfg.job.dry_run:  # the layout is for the real cluster, not this process
        validate(cfg)
        dry_run(cfg)
        return None
    rank, local_rank, world_size = launch_env()
    if cfg.checkpoint.create_seed_checkpoint:  # one CPU process, whatever the layout
        from checkpoint.seed import create_seed_checkpoint

        validate(cfg)
        setup_logging(cfg.job.dump_folder, rank)
        create_seed_checkpoint(cfg, world_size)
        return None
    parallel_dims = check_config(cfg, world_size)
    # the family's default resolved, so that the written config shows what the run uses
    cfg.optimizer.no_decay_patterns = no_decay_patterns(cfg)
    check_data_files(cfg)  # here, not in check_config: dry runs plan without the data
    pick_device(cfg.training.device, local_rank)  # no GPU, or more ranks than GPUs
    return Launch(cfg, parallel_dims, rank, local_rank)


def log_job(cfg: JobConfig, rank: int) -> None:
    """The resolved config (rank 0 also writes it to <dump_folder>/config.toml), its notes
    and the job's description."""
    if rank == 0:
        text = config_to_toml(cfg)
        Path(cfg.job.dump_folder, "config.toml").write_text(text)
        logger.info("resolved config (also in %s/config.toml):\n%s", cfg.job.dump_folder, text)
    for note in config_notes(cfg):
        logger.info("config: %s", note)
    if cfg.job.description:
        logger.info("job: %s", cfg.job.description)


def run_job(launch: Launch) -> int:
    """Runs the training with signals installed; the exit code."""
    from training.loop import NonFiniteError, StepError  # heavy imports after the checks
    from training.trainer import run_training

    stop = StopFlag()
    stop.install()
    try:
        run_training(
            launch.cfg,
            launch.parallel_dims,
            rank=launch.rank,
            local_rank=launch.local_rank,
            stop=stop,
        )
    except (NonFiniteError, CheckpointError) as e:
        logger.error("%s", e)
        record_error(e)
        return 1
    except StepError as e:
        logger.error("%s", e, exc_info=e.__cause__)
        record_error(e)
        return 1
    except KeyboardInterrupt:
        logger.info("interrupted")
        return 130
    finally:
        from training.distributed import cleanup

        cleanup()
        for h in logger.handlers:
            h.flush()
    return 0


def run(argv: list[str]) -> int:
    """Checks and runs the job that `argv` (train.py's options) describes; the exit status:
    2 for a config or launch error, reported before any work."""
    try:
        launch = prepare(argv)
    except (ConfigError, ParallelismError, LaunchError, CheckpointError) as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2
    if launch is None:
        return 0
    setup_logging(launch.cfg.job.dump_folder, launch.rank)
    log_job(launch.cfg, launch.rank)
    return run_job(launch)
