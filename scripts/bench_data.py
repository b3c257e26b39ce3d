"""Data-path benchmark (#26): per-rank loader time per step at simulated DP degrees, loader
start-up on a generated pre-tokenised corpus, and pre-tokenisation throughput.

    python scripts/bench_data.py loader --out benchmarks/cpu_data    # per-rank step time
    python scripts/bench_data.py startup --tokens 1000000000 --out benchmarks/cpu_data
    python scripts/bench_data.py pretokenize --workers 1 2 --out benchmarks/cpu_data

`loader`: one rank of N (the last, rank N - 1) is built in this process for each N and timed
over its steps; the global batch grows with N (local batch fixed), as at scale. Sources: a
pre-tokenised Megatron corpus (shuffled), a streamed Hugging Face dataset (a local JSONL
folder) read as one stream, and one of --shards files read as that many virtual shards
(training.stream_shards). Results go to <out>/loader.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def write_corpus(prefix: Path, tokens: int, vocab: int = 4096, doc_len: int = 1000) -> None:
    """A Megatron corpus of `tokens` random ids in documents of `doc_len` tokens, written in
    chunks (memory stays small)."""
    from data.indexed import write_index

    chunk = 50_000_000
    with open(f"{prefix}.bin", "wb") as out:
        rng = np.random.default_rng(0)
        for start in range(0, tokens, chunk):
            out.write(rng.integers(0, vocab, min(chunk, tokens - start), dtype=np.uint16).tobytes())
    lengths = np.full(tokens // doc_len, doc_len, dtype=np.int64)
    lengths[-1] += tokens - lengths.sum()
    write_index(f"{prefix}.idx", lengths, 8)


def bench_loader(args, tokenizer) -> list[dict]:
    from data.dataloader import build_dataloader

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_corpus(Path(tmp) / "corpus", 20_000_000)
        hf = Path(tmp) / "hf"
        hf.mkdir()
        text = " ".join(f"word{i % 97}" for i in range(400))
        (hf / "train.jsonl").write_text(
            "".join(json.dumps({"text": f"{i} {text}"}) + "\n" for i in range(2000))
        )
        sharded = Path(tmp) / "hf_sharded"  # one file per virtual shard
        sharded.mkdir()
        for f in range(args.shards):
            (sharded / f"train-{f:05d}.jsonl").write_text(
                "".join(
                    json.dumps({"text": f"{f} {i} {text}"}) + "\n" for i in range(args.shard_docs)
                )
            )
        sources = (
            ("megatron", f"{tmp}/corpus", 0, 1),
            ("huggingface", str(hf), None, 1),
            ("huggingface", str(sharded), None, args.shards),
        )
        for kind, path, seed, shards in sources:
            label = kind if shards == 1 else f"{kind} ({shards} stream shards)"
            for dp in args.dp:
                if kind == "huggingface" and shards == 1 and dp > args.max_stream_dp:
                    continue
                data = build_dataloader(
                    dataset=kind, dataset_path=path, tokenizer=tokenizer, seq_len=args.seq_len,
                    local_batch_size=args.batch, dp_rank=dp - 1, dp_degree=dp, shuffle_seed=seed,
                    cache_dir=f"{tmp}/cache", stream_shards=shards,
                )  # fmt: skip
                it = iter(data)
                # warm-up: opens the files/stream, and every shard this rank reads (a one-time
                # cost per shard, timed apart)
                warmup = max(1, -(-shards // (dp * args.batch)))
                start = time.perf_counter()
                for _ in range(warmup):
                    next(it)
                opening = time.perf_counter() - start
                start = time.perf_counter()
                for _ in range(args.steps):
                    next(it)
                per_step = (time.perf_counter() - start) / args.steps
                rows.append({"source": label, "dp": dp, "ms_per_step": per_step * 1e3,
                             "warmup_steps": warmup, "warmup_s": opening})  # fmt: skip
                print(f"{label:40s} dp {dp:5d}: {per_step * 1e3:8.3f} ms/step "
                      f"(warm-up {warmup} steps, {opening:.2f} s)", flush=True)  # fmt: skip
    for row in rows:
        base = next(r for r in rows if r["source"] == row["source"] and r["dp"] == 1)
        row["vs_dp1"] = row["ms_per_step"] / base["ms_per_step"]
    return rows


def bench_startup(args, tokenizer) -> dict:
    from data.dataloader import build_dataloader

    folder = Path(args.corpus_dir or tempfile.mkdtemp())
    prefix = folder / "bench_corpus"
    start = time.perf_counter()
    if not Path(f"{prefix}.idx").exists():
        write_corpus(prefix, args.tokens)
    written = time.perf_counter() - start
    start = time.perf_counter()
    data = build_dataloader(dataset="megatron", dataset_path=str(prefix), tokenizer=tokenizer,
                            seq_len=args.seq_len, local_batch_size=args.batch, dp_rank=0,
                            dp_degree=8, shuffle_seed=0)  # fmt: skip
    next(iter(data))
    startup = time.perf_counter() - start
    print(f"{args.tokens} tokens: written in {written:.1f} s, loader start-up + first batch "
          f"{startup:.3f} s", flush=True)  # fmt: skip
    if not args.corpus_dir:
        for suffix in (".bin", ".idx"):
            Path(f"{prefix}{suffix}").unlink()
    return {"tokens": args.tokens, "startup_s": startup, "write_s": written}


def bench_pretokenize(args) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in"
        src.mkdir()
        text = " ".join(f"word{i % 331} token{i % 17}" for i in range(300))
        for f in range(args.files):
            docs = (json.dumps({"text": f"{f} {i} {text}"}) + "\n" for i in range(args.docs))
            (src / f"part{f:03d}.jsonl").write_text("".join(docs))
        chars = sum(p.stat().st_size for p in src.iterdir())
        # (workers, tokenizer threads per worker): one thread each shows the scaling over
        # processes; 0 is the script's default (the cores shared among the workers)
        for workers, threads in [(w, t) for t in args.threads for w in args.workers]:
            dest = Path(tmp) / f"out{workers}_{threads}"
            cmd = [sys.executable, str(ROOT / "scripts/pretokenize.py"), "--format", "jsonl",
                   "--input", str(src), "--output", str(dest), "--tasks", str(args.files),
                   "--workers", str(workers), "--threads", str(threads)]  # fmt: skip
            if args.executor == "slurm":  # a running cluster (SLURM_CONF), its debug partition
                cmd += ["--executor", "slurm", "--partition", args.partition, "--time", "30",
                        "--cpus-per-task", str(threads or 1), "--mem-per-cpu-gb", "1",
                        "--srun-arg", "mpi=none"]  # fmt: skip
            start = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True, env={**os.environ})
            while len(list(dest.glob("*.meta.json"))) < args.files:  # the array's tasks
                time.sleep(0.2)
            seconds = time.perf_counter() - start
            tokens = sum(json.loads(p.read_text())["num_tokens"] for p in dest.glob("*.meta.json"))
            out.append({"executor": args.executor, "workers": workers, "threads": threads,
                        "seconds": seconds, "tokens": tokens,
                        "tokens_per_s": tokens / seconds, "input_mb": chars / 1e6})  # fmt: skip
            print(f"{workers} workers x {threads or 'default'} threads: {tokens} tokens in {seconds:.1f} s = "
                  f"{tokens / seconds:,.0f} tokens/s", flush=True)  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("what", choices=("loader", "startup", "pretokenize"))
    p.add_argument("--out", default="")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 8, 64, 512, 1024])
    p.add_argument("--max-stream-dp", type=int, default=64)
    p.add_argument("--shards", type=int, default=1024, help="loader: stream shards (files)")
    p.add_argument("--shard-docs", type=int, default=48, help="loader: documents per shard file")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=1_000_000_000)
    p.add_argument("--corpus-dir", default="")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 0])
    p.add_argument(
        "--executor",
        choices=("local", "slurm"),
        default="local",
        help="pretokenize: slurm submits a --files-task job array to the running "
        "cluster SLURM_CONF names (start one as tests/integration/test_slurm.py does)",
    )
    p.add_argument("--partition", default="debug", help="pretokenize --executor slurm")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--docs", type=int, default=1500)
    args = p.parse_args()
    from data.cache import default_cache_dir
    from data.sample_corpus import ensure_sample_tokenizer
    from data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(ensure_sample_tokenizer(default_cache_dir()))
    if args.what == "loader":
        result = bench_loader(args, tokenizer)
    elif args.what == "startup":
        result = bench_startup(args, tokenizer)
    else:
        result = bench_pretokenize(args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        slurm = args.what == "pretokenize" and args.executor == "slurm"
        name = f"{args.what}{'_slurm' if slurm else ''}.json"
        Path(args.out, name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
