"""meshtrain entry point: `torchrun --nproc_per_node N train.py --config NAME [--section.key V]`.

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
from torch.distributed.elastic.multiprocessing.errors import record

from checkpoint import CheckpointError
from job_config import ConfigError, JobConfig, config_notes, config_to_toml, help_text, parse_args
from job_config.checks import check_layout_options, validate
from job_config.problems import Problems
from models import get_model_spec, import_families, model_args_for
from parallelisms.parallel_dims import ParallelDims, ParallelismError
from parallelisms.pipeline import validate_pipeline_config
from training.distributed import LaunchError, device_type, launch_env, pick_device, record_error

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


def check_config(cfg: JobConfig, world_size: int) -> ParallelDims:
    """Every check that needs only the config and the world size, before any real work; the
    independent problems are all reported in one error."""
    problems = Problems(ConfigError, ParallelismError)
    problems.run(validate, cfg)  # again after parse_args: cheap, and main skips it there
    try:  # an unknown model name or flavor
        args = model_args_for(cfg.model, cfg.training.seq_len, None)
    except ValueError as e:
        problems.add(str(e))
        args = None
    p, t = cfg.parallelism, cfg.training
    dims = problems.run(ParallelDims.from_parallelism, p, world_size)
    if dims is not None:
        per_micro = t.local_batch_size * dims.dp
        if t.global_batch_size != -1 and t.global_batch_size % per_micro:
            problems.add(
                f"training.global_batch_size = {t.global_batch_size} must be a multiple of "
                f"local_batch_size ({t.local_batch_size}) x data-parallel degree ({dims.dp}) = "
                f"{per_micro}; the quotient is the number of gradient-accumulation steps."
            )
        if t.enable_cpu_offload and not (dims.data_parallel_enabled and dims.zero_stage == 3):
            problems.add(
                "training.enable_cpu_offload = true needs FSDP: zero_stage = 3 and a "
                "data-parallel (x context_parallel) degree > 1 (got zero_stage "
                f"{dims.zero_stage}, data-parallel degree {dims.dp * dims.cp})."
            )
        # CP ranks hold other tokens: their gradients are reduced and their weights sharded
        check_layout_options(cfg, dims.dp * dims.cp, problems)
    if args is not None:
        from parallelisms.decoder import decoder_problems

        spec = get_model_spec(cfg.model.name)
        for problem in decoder_problems(spec, cfg, args):
            problems.add(ParallelismError(problem))
        if p.expert_parallel_degree > 1 and spec.routing is None:
            problems.add(
                f"parallelism.expert_parallel_degree = {p.expert_parallel_degree}: model.name = "
                f"'{cfg.model.name}' has no experts. Use a mixture-of-experts family (qwen3_moe) "
                "or expert_parallel_degree = 1."
            )
        problems.run(
            validate_pipeline_config,
            p,
            t.local_batch_size,
            args.n_layers,
            device_type=device_type(t.device),
            per_op_ac=cfg.activation_checkpoint.mode == "selective"
            and cfg.activation_checkpoint.selective_ac_option == "op",
        )
    problems.raise_any()
    return dims


def check_data_files(cfg: JobConfig) -> None:
    """Local dataset paths must match files before the model is built."""
    from data.sources import FILE_EXTENSIONS, resolve_files

    t, v = cfg.training, cfg.validation
    sources = [("training", t.dataset, t.dataset_path)]
    if v.enable:
        sources.append(("validation", v.dataset or t.dataset, v.dataset_path or t.dataset_path))
    for section, kind, path in sources:
        if kind in FILE_EXTENSIONS:
            try:
                resolve_files(kind, path)
            except ValueError as e:
                raise ConfigError(f"{section}.dataset_path: {e}") from None


def param_counts(spec, model) -> tuple[str, int]:
    """(the dry run's parameter counts, the non-embedding count the FLOPs per token use): for
    a mixture of experts also the parameters one token uses, which the FLOPs count."""
    from metrics.flops import count_params

    n = count_params(model)
    n_no_emb = count_params(model, exclude_embedding=True)
    text = f"{n:,} parameters ({n / 1e9:.2f}B; {n_no_emb:,} without embeddings)"
    if spec.routing is None:
        return text, n_no_emb
    active_no_emb = spec.routing.active_params(model)  # as the trainer's MFU counts them
    active = active_no_emb + n - n_no_emb
    text += (
        f", {active:,} active per token ({active / 1e9:.2f}B; {active_no_emb:,} without embeddings)"
    )
    return text, active_no_emb


def dry_run(cfg: JobConfig) -> None:
    """Builds the model on the meta device (allocating nothing) and reports its size."""
    from metrics.flops import flops_per_token

    vocab = None  # the flavor's vocabulary unless the tokenizer file is at hand
    if cfg.model.tokenizer_path and Path(cfg.model.tokenizer_path).is_file():
        from data.tokenizer import build_tokenizer

        vocab = build_tokenizer(cfg.model.tokenizer_path).vocab_size
    spec = get_model_spec(cfg.model.name)
    try:
        args = model_args_for(cfg.model, cfg.training.seq_len, vocab)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    with torch.device("meta"):
        model = spec.model_cls(args)
    counts, n_no_emb = param_counts(spec, model)
    fpt = flops_per_token(n_no_emb, args.n_layers, args.n_heads, args.head_dim, args.max_seq_len)
    print(
        f"dry run: {cfg.model.name} {cfg.model.flavor}: {counts}, "
        f"{fpt / 1e9:.2f} GFLOP per token at seq_len {args.max_seq_len}"
    )
    if cfg.job.simulate_world_size:  # per-rank memory of the configured layout at that scale
        from planning.simulate import format_plan, simulate

        world = cfg.job.simulate_world_size
        check_config(cfg, world)
        gib = 80.0
        if torch.cuda.is_available():
            gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        print(format_plan(simulate(spec, args, cfg, world), gib))


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
    try:  # before any check: it may register the model family the config names
        import_families(cfg.job.custom_import)
    except ValueError as e:
        raise ConfigError(str(e)) from None
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


@record  # an uncaught exception goes to torchrun's error file too (see record_error)
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
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


if __name__ == "__main__":
    sys.exit(main())
