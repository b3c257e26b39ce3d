"""Pre-tokenise a corpus into sharded Megatron indexed datasets with datatrove, on every core of
one machine or as a SLURM job array (data/pretokenize.py describes the pipeline):

    python scripts/pretokenize.py --format jsonl --input my_corpus/ --output tokens/ \\
        --tokenizer tokenizer.model --tasks 16 --workers 16
    python scripts/pretokenize.py ... --executor slurm --tasks 64 --partition cpu --time 4:00:00

then train on it: `--training.dataset megatron --training.dataset_path tokens/`. Run the same
command again after a kill: finished tasks are skipped, their shards kept. Options may also come
from a TOML file (`--config pretok.toml`, keys named as the options with `_` for `-`); the
command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import tomllib

from data.pretokenize import FORMATS, forget_lost_shards, pipeline


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="TOML file of option values (keys as below, '-' -> '_')")
    p.add_argument("--format", choices=FORMATS, help="input format (sample: the bundled corpus)")
    p.add_argument("--input", default="", help="file or folder; huggingface: name[:config]")
    p.add_argument("--output", help="folder of the shards (<task>.bin/.idx/.meta.json)")
    p.add_argument("--tokenizer", default="", help="tokenizer file ('' = the bundled sample one)")
    p.add_argument("--text-field", default="text", help="JSONL/Parquet/HF field of the text")
    p.add_argument("--split", default="train", help="huggingface: the split to read")
    p.add_argument("--tasks", type=int, default=1, help="shards (input files are dealt to them)")
    p.add_argument("--workers", type=int, default=-1, help="local: processes (-1 = tasks)")
    p.add_argument("--threads", type=int, default=0,
                   help="tokenizer threads per task (0 = local: cores / workers; slurm: "
                   "--cpus-per-task)")  # fmt: skip
    p.add_argument("--executor", choices=("local", "slurm"), default="local")
    p.add_argument("--logging-dir", help="datatrove's logs/completions (default <output>.logs)")
    p.add_argument("--partition", default="", help="slurm: partition")
    p.add_argument("--time", default="1:00:00", help="slurm: time limit per task")
    p.add_argument("--cpus-per-task", type=int, default=1, help="slurm: CPUs per task")
    p.add_argument("--mem-per-cpu-gb", type=int, default=2, help="slurm: memory per CPU")
    p.add_argument("--job-name", default="pretokenize", help="slurm: job name")
    p.add_argument("--srun-arg", action="append", default=[], help="slurm: srun KEY=VALUE")
    p.add_argument("--sbatch-arg", action="append", default=[], help="slurm: sbatch KEY=VALUE")
    args = p.parse_args(argv)
    if args.config:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv or sys.argv[1:]}
        for key, value in tomllib.loads(Path(args.config).read_text()).items():
            if not hasattr(args, key):
                p.error(f"{args.config}: unknown option {key!r}")
            if key not in given:
                setattr(args, key, value)
    for required in ("format", "output"):
        if not getattr(args, required):
            p.error(f"--{required} is required (on the command line or in --config)")
    if args.format not in ("sample",) and not args.input:
        p.error("--input is required for --format " + args.format)
    return args


def executor(args: argparse.Namespace):
    """datatrove's local or SLURM executor over the pipeline."""
    from data.cache import default_cache_dir
    from data.sample_corpus import ensure_sample_tokenizer

    tokenizer = args.tokenizer or ensure_sample_tokenizer(default_cache_dir())
    logs = args.logging_dir or f"{str(args.output).rstrip('/')}.logs"
    lost = forget_lost_shards(args.output, logs, args.tasks)
    if lost:
        print(f"tasks {lost} were marked done in {logs} but their shards are missing from "
              f"{args.output}: they run again", flush=True)  # fmt: skip
    if args.threads:
        threads = args.threads
    elif args.executor == "local":
        workers = args.tasks if args.workers == -1 else args.workers
        threads = max(1, len(os.sched_getaffinity(0)) // max(1, min(workers, args.tasks)))
    else:
        threads = args.cpus_per_task
    steps = pipeline(
        args.format, args.input, args.output, tokenizer, args.text_field, threads, args.split
    )
    if args.executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        return LocalPipelineExecutor(
            steps, tasks=args.tasks, workers=args.workers, logging_dir=logs
        )
    from datatrove.executor import SlurmPipelineExecutor

    activate = Path(sys.prefix) / "bin" / "activate"
    return SlurmPipelineExecutor(
        steps,
        tasks=args.tasks,
        time=args.time,
        partition=args.partition,
        cpus_per_task=args.cpus_per_task,
        mem_per_cpu_gb=args.mem_per_cpu_gb,
        job_name=args.job_name,
        logging_dir=logs,
        venv_path=str(activate) if activate.is_file() else None,
        srun_args=dict(a.split("=", 1) for a in args.srun_arg) or None,
        sbatch_args=dict(a.split("=", 1) for a in args.sbatch_arg) or None,
        mail_type="NONE",
    )


def main(argv: list[str] | None = None) -> None:
    executor(parse(argv)).run()


if __name__ == "__main__":
    main()
