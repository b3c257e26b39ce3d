"""Document sources: resolve files/folders/globs and read their documents as plain strings.

- text: every file is one document (its whole UTF-8 content; undecodable bytes become U+FFFD).
- jsonl: one JSON object per non-blank line; the document is its `text_field` string.
- parquet: one document per row of the `text_field` column (read in record batches via pyarrow).
- huggingface: `datasets.load_dataset(path, name, split=split, streaming=True)`, one document
  per example's `text_field`.

Files found in a folder (recursively, hidden files skipped) or by a glob are read in sorted path
order, so the document order, and with it the whole token stream, is deterministic.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

FILE_EXTENSIONS = {
    "text": (".txt",),
    "jsonl": (".jsonl", ".json"),
    "parquet": (".parquet",),
}


def resolve_files(kind: str, path_spec: str) -> list[str]:
    """Expand a file, folder or glob into the sorted absolute paths of its `kind` files."""
    extensions = FILE_EXTENSIONS[kind]
    if not path_spec:
        raise ValueError(
            f"dataset {kind!r} needs dataset_path: a file, a folder of {'/'.join(extensions)} "
            "files or a glob"
        )
    path = Path(path_spec).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = [
            p
            for p in path.rglob("*")
            if p.is_file() and p.name.endswith(extensions) and not _is_hidden(p, path)
        ]
    else:
        files = [Path(p) for p in glob.glob(str(path), recursive=True) if os.path.isfile(p)]
    if not files:
        raise ValueError(
            f"dataset_path {path_spec!r} matches no {kind} files; pass an existing file, a folder "
            f"containing {'/'.join(extensions)} files, or a glob such as 'data/*{extensions[0]}'"
        )
    return sorted(str(p.resolve()) for p in files)


def iter_documents(kind: str, files: list[str], text_field: str) -> Iterator[str]:
    """Yield the documents of the given files in order."""
    readers: dict[str, Callable[[str, str], Iterator[str]]] = {
        "text": _read_text,
        "jsonl": _read_jsonl,
        "parquet": _read_parquet,
    }
    for file in files:
        yield from readers[kind](file, text_field)


def open_hf_stream(
    dataset_path: str, split: str, text_field: str, num_shards: int = 1
) -> list[Callable[[int], Iterator]]:
    """Return one `open(skip)` per shard: a fresh iterator over the shard's streamed texts after
    `skip` of its examples.

    `dataset_path` is anything `load_dataset` accepts (a hub name or a local folder), optionally
    followed by `:config_name` (e.g. `allenai/c4:en`). With `num_shards` > 1 the dataset's data
    files are split into that many contiguous groups (`IterableDataset.shard`), so reading a
    shard opens only its own files; it needs at least `num_shards` files.
    """
    import datasets  # slow import, only needed for this source

    path, name = _split_config(dataset_path)
    try:
        stream = datasets.load_dataset(path, name, split=split, streaming=True)
    except Exception as err:
        raise ValueError(
            f"cannot stream Hugging Face dataset {dataset_path!r} split {split!r}: {err}"
        ) from err
    files = stream.n_shards
    if num_shards > files:
        raise ValueError(
            f"training.stream_shards = {num_shards}, but Hugging Face dataset {dataset_path!r} "
            f"split {split!r} has only {files} data file(s) to split among them: use at most "
            f"{files} (ideally a multiple of the data-parallel degree that divides {files})"
        )

    def opener(shard: int) -> Callable[[int], Iterator[str]]:
        part = stream.shard(num_shards, shard) if num_shards > 1 else stream
        where = f"{dataset_path!r}" + (f" shard {shard}/{num_shards}" if num_shards > 1 else "")

        def open_from(skip: int) -> Iterator[str]:
            for index, example in enumerate(part.skip(skip) if skip else part, start=skip):
                yield _text_of(example, text_field, f"{where} example {index}")

        return open_from

    return [opener(shard) for shard in range(num_shards)]


def _read_text(file: str, text_field: str) -> Iterator[str]:
    """The whole file is one document."""
    yield Path(file).read_text(encoding="utf-8", errors="replace")


def _read_jsonl(file: str, text_field: str) -> Iterator[str]:
    """One document per JSON line."""
    with open(file, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}:{number} is not valid JSON ({err})") from err
            yield _text_of(record, text_field, f"{file}:{number}")


def _read_parquet(file: str, text_field: str) -> Iterator[str]:
    """One document per row of the text column."""
    parquet = pq.ParquetFile(file)
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise ValueError(
            f"parquet file {file!r} has no column {text_field!r} (columns: {columns}); "
            "pass text_field=<the column holding the text>"
        )
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield _check_text(text, text_field, file)


def _text_of(record: Any, text_field: str, where: str) -> str:
    """Return record[text_field], or raise a ValueError naming the record and the fix."""
    if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"{where} has no field {text_field!r} (fields: {keys}); "
            "pass text_field=<the field holding the text>"
        )
    return _check_text(record[text_field], text_field, where)


def _check_text(value: Any, text_field: str, where: str) -> str:
    """Documents must be strings (None counts as an empty document)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {text_field!r} is {type(value).__name__}, not a string")
    return value


def _split_config(dataset_path: str) -> tuple[str, str | None]:
    """Split `path:config` unless the whole string is an existing local path."""
    if ":" in dataset_path and not os.path.exists(dataset_path):
        path, name = dataset_path.rsplit(":", 1)
        return path, name or None
    return dataset_path, None


def _is_hidden(path: Path, root: Path) -> bool:
    """True if any component below `root` starts with a dot."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)
