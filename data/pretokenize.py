"""Parallel pre-tokenisation on Hugging Face `datatrove`: text, JSONL, Parquet files or a
Hugging Face dataset into sharded Megatron indexed datasets the trainer reads by memory map
(`training.dataset = "megatron"`, `training.dataset_path = <output folder>`).

A datatrove pipeline of two steps, run by datatrove's local executor (one machine, `workers`
processes) or its SLURM executor (a job array of `tasks` tasks), the same pipeline either way:

1. a datatrove reader: each task reads its share of the input files (datatrove deals files
   out round-robin: file i goes to task i mod tasks) or of the streamed dataset's shards;
2. `TokenizeToIndexed`: meshtrain's own tokenizer (any format `data.tokenizer` reads, framed as
   the trainer frames documents: [BOS] tokens [EOS]) writes the task's documents as
   `<output>/<task:05d>.bin` + `.idx` (one document per sequence) and `<task:05d>.meta.json`
   (the tokenizer's fingerprint, which the trainer checks, and the counts).

A task writes under temporary names and renames them into place when it is done, and datatrove
marks it completed in `<logging_dir>/completions/`: a pipeline killed part way and started again
with the same arguments skips the finished tasks (their shards are kept) and redoes the others.
Progress is datatrove's log (per task and per file: `<logging_dir>/logs/`, stats in
`<logging_dir>/stats/`). The corpus is the output folder's shards in task order.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.readers.base import BaseDiskReader
from datatrove.utils.batching import batched

from data.indexed import token_dtype, write_indexed

FORMATS = ("text", "jsonl", "parquet", "huggingface", "sample")
_GLOBS = {"text": "**/*.txt", "jsonl": "**/*.jsonl", "parquet": "**/*.parquet"}
_ENCODE_BATCH = 256


class TextFileReader(BaseDiskReader):
    """datatrove reader of plain text files: each file is one document (as the trainer's `text`
    source reads them)."""

    name = "📄 Text files"

    def read_file(self, filepath: str) -> Iterator[Any]:
        with self.data_folder.open(filepath, "r", encoding="utf-8", errors="replace") as file:
            document = self.get_document_from_dict({"text": file.read()}, filepath, 0)
        if document:
            yield document


class TokenizeToIndexed(PipelineStep):
    """Tokenise the task's documents with a meshtrain tokenizer into one indexed-dataset shard."""

    name = "🔢 meshtrain tokenizer"
    type = "🔢 - TOKENIZER"

    def __init__(self, output_folder: str, tokenizer_path: str, threads: int = 1) -> None:
        super().__init__()
        self.output_folder = str(output_folder)
        self.tokenizer_path = tokenizer_path
        self.threads = threads  # the tokenizer's threads in this task (its share of the cores)

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from data.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(self.tokenizer_path)
        dtype = token_dtype(tokenizer.vocab_size)
        out = Path(self.output_folder)
        out.mkdir(parents=True, exist_ok=True)
        final = [out / f"{rank:05d}{suffix}" for suffix in (".bin", ".idx", ".meta.json")]
        temps = [path.with_name(f".{path.name}.{os.getpid()}.tmp") for path in final]

        def encoded() -> Iterator[np.ndarray]:
            texts = (doc.text for doc in data if doc.text)
            for batch in batched(texts, _ENCODE_BATCH):
                with self.track_time(unit="batch"):
                    ids = tokenizer.encode_batch(list(batch), True, True, threads=self.threads)
                for one in ids:
                    self.stat_update("documents")
                    self.stat_update("tokens", value=len(one))
                    yield np.asarray(one, dtype=dtype)

        try:
            docs, tokens = write_indexed(temps[0], temps[1], encoded(), dtype)
            meta = {
                "tokenizer": tokenizer.fingerprint,
                "tokenizer_path": self.tokenizer_path,
                "task": rank,
                "tasks": world_size,
                "num_docs": docs,
                "num_tokens": tokens,
            }
            temps[2].write_text(json.dumps(meta, indent=1))
            for temp, path in zip(temps, final):  # the .meta.json last: the shard is complete
                os.replace(temp, path)
        finally:
            for temp in temps:
                temp.unlink(missing_ok=True)
        return
        yield  # a generator that passes no documents on


def reader(kind: str, path: str, text_field: str = "text", split: str = "train") -> PipelineStep:
    """The datatrove reader of `path` (a file or folder; for huggingface a dataset name or
    local folder, with an optional `:config`)."""
    if kind == "sample":
        from data.cache import default_cache_dir
        from data.sample_corpus import ensure_sample_corpus

        path, kind = ensure_sample_corpus(default_cache_dir())[0], "jsonl"
    if kind == "huggingface":
        from datatrove.pipeline.readers import HuggingFaceDatasetReader

        from data.sources import _split_config

        name, config = _split_config(path)
        options = {"split": split, **({"name": config} if config else {})}
        return HuggingFaceDatasetReader(name, options, streaming=True, text_key=text_field)
    if kind not in _GLOBS:
        raise ValueError(f"unknown input format {kind!r}; choose one of {', '.join(FORMATS)}")
    source = Path(path).expanduser().resolve()
    if source.is_file():
        folder, pattern = str(source.parent), source.name
    elif source.is_dir():
        folder, pattern = str(source), _GLOBS[kind]
    else:
        raise ValueError(f"input {path!r} is neither a file nor a folder")
    options = {"glob_pattern": pattern, "text_key": text_field, "file_progress": True}
    if kind == "text":
        return TextFileReader(folder, **options)
    if kind == "jsonl":
        from datatrove.pipeline.readers import JsonlReader

        return JsonlReader(folder, **options)
    from datatrove.pipeline.readers import ParquetReader

    return ParquetReader(folder, **options)


def pipeline(
    kind: str,
    path: str,
    output: str,
    tokenizer_path: str,
    text_field: str = "text",
    threads: int = 1,
    split: str = "train",
) -> list[PipelineStep]:
    """The two steps: read, then tokenise into the output folder's shards with `threads`
    tokenizer threads per task (parallelism comes from the tasks: one thread each when there
    are as many workers as cores); `split` is the Hugging Face dataset's split."""
    return [
        reader(kind, path, text_field, split),
        TokenizeToIndexed(output, tokenizer_path, threads),
    ]


def forget_lost_shards(output: str, logging_dir: str, tasks: int) -> list[int]:
    """Tasks that datatrove marks completed but whose shard is no longer in `output` (the
    output folder was deleted or moved, the logs kept): their marks are removed so that a
    rerun tokenises them again instead of skipping them and leaving no corpus."""
    lost = []
    for task in range(tasks):
        mark = Path(logging_dir) / "completions" / f"{task:05d}"
        if mark.is_file() and not (Path(output) / f"{task:05d}.meta.json").is_file():
            mark.unlink()
            lost.append(task)
    return lost
