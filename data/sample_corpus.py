"""Offline sample corpus and tokenizer, built on first use from the Python standard library.

Every machine with Python has its standard library sources and `pydoc_data.topics`, so debug
runs and tests need no downloads. The corpus is a deterministic ~8 MB subset of the stdlib's
`*.py` files (test suites and site-packages excluded) plus all pydoc topics, one document each,
ordered by a hash of the document's name and split about 99/1 (by characters, whole documents)
into `train.jsonl` / `validation.jsonl` records `{"text": ..., "source": ...}`.

Cache layout under `cache_dir`::

    sample_corpus/<key>/train.jsonl
    sample_corpus/<key>/validation.jsonl
    sample_corpus/<key>/tokenizer_bpe<vocab_size>.model

`<key>` hashes the Python version and the chosen files' names and sizes, so a different stdlib
gets its own corpus. All files are written once under a lock and renamed into place atomically,
so any number of concurrent ranks may call these functions.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

from data.cache import build_once, default_cache_dir

__all__ = [
    "SAMPLE_TOKENIZER_VOCAB_SIZE",
    "default_cache_dir",
    "ensure_sample_corpus",
    "ensure_sample_tokenizer",
]

# 4096 BPE pieces (incl. 256 byte-fallback pieces and unk/bos/eos): small enough for a debug
# model's embedding, large enough to compress Python source ~3.5 characters per token.
SAMPLE_TOKENIZER_VOCAB_SIZE = 4096

_CORPUS_BYTES = 8_000_000  # budget of stdlib source bytes
_MAX_FILE_BYTES = 128_000  # skip the few huge modules so no single document dominates a split
_VALIDATION_FRACTION = 0.01
_TOKENIZER_TRAIN_CHARS = 4_000_000  # train the tokenizer on (at most) this much train text
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_SKIPPED_DIRS |= {"pydoc_data"}  # topics are added as separate documents instead


def ensure_sample_corpus(cache_dir: str | None = None) -> tuple[str, str]:
    """Build (once) and return the (train_path, validation_path) JSONL files of the corpus."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = _select_stdlib_files(stdlib)
    folder = _corpus_folder(cache_dir, files)
    train, validation = folder / "train.jsonl", folder / "validation.jsonl"
    build_once([validation, train], lambda temps: _write_corpus(stdlib, files, *temps))
    return str(train), str(validation)


def ensure_sample_tokenizer(
    cache_dir: str | None = None, vocab_size: int = SAMPLE_TOKENIZER_VOCAB_SIZE
) -> str:
    """Train (once) a sentencepiece BPE model on the corpus' train part; return its path."""
    train, _ = ensure_sample_corpus(cache_dir)
    target = Path(train).parent / f"tokenizer_bpe{vocab_size}.model"
    build_once([target], lambda temps: _train_tokenizer(Path(train), temps[0], vocab_size))
    return str(target)


@functools.cache  # one walk of the stdlib per process (the tokenizer and the loader both ask)
def _select_stdlib_files(stdlib: Path) -> tuple[tuple[str, int], ...]:
    """Pick a deterministic (hash-ordered) subset of stdlib sources: (relative path, size)."""
    candidates = []
    for folder, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        for name in names:
            if name.endswith(".py"):
                path = Path(folder) / name
                size = path.stat().st_size
                if 0 < size <= _MAX_FILE_BYTES:
                    candidates.append((path.relative_to(stdlib).as_posix(), size))
    candidates.sort(key=lambda item: _name_hash(item[0]))
    chosen, total = [], 0
    for rel, size in candidates:
        if total >= _CORPUS_BYTES:
            break
        chosen.append((rel, size))
        total += size
    return tuple(chosen)


def _corpus_folder(cache_dir: str | None, files: tuple[tuple[str, int], ...]) -> Path:
    """Cache folder named by a hash of the Python version and the chosen files."""
    identity = json.dumps([list(sys.version_info[:3]), files])
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return Path(cache_dir or default_cache_dir()) / "sample_corpus" / key


def _documents(stdlib: Path, files: tuple[tuple[str, int], ...]) -> list[tuple[str, str]]:
    """All (source name, text) documents in their deterministic hash order."""
    import pydoc_data.topics  # only needed while building

    docs = [
        (f"stdlib/{rel}", (stdlib / rel).read_text(encoding="utf-8", errors="replace"))
        for rel, _ in files
    ]
    docs += [(f"pydoc_topics/{name}", text) for name, text in pydoc_data.topics.topics.items()]
    docs.sort(key=lambda doc: _name_hash(doc[0]))
    return docs


def _write_corpus(stdlib: Path, files: tuple[tuple[str, int], ...], val_tmp: Path, train_tmp: Path):
    """Write the documents to the two JSONL files, ~1% of characters going to validation."""
    seen_chars = val_chars = 0
    with (
        open(train_tmp, "w", encoding="utf-8") as train,
        open(val_tmp, "w", encoding="utf-8") as val,
    ):
        for source, text in _documents(stdlib, files):
            record = json.dumps({"text": text, "source": source}, ensure_ascii=True) + "\n"
            if val_chars < _VALIDATION_FRACTION * seen_chars:
                val.write(record)
                val_chars += len(text)
            else:
                train.write(record)
            seen_chars += len(text)


def _train_tokenizer(train_jsonl: Path, output: Path, vocab_size: int) -> None:
    """Train a byte-fallback BPE sentencepiece model on the first lines of the train part."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_training_lines(train_jsonl),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,  # any text round-trips, including newlines
        normalization_rule_name="identity",  # keep code whitespace exactly
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,  # indentation pieces
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        input_sentence_size=0,
        max_sentence_length=16384,
        num_threads=2,
        minloglevel=2,
    )
    output.write_bytes(model.getvalue())


def _training_lines(train_jsonl: Path) -> Iterator[str]:
    """Non-blank lines of the train documents, up to _TOKENIZER_TRAIN_CHARS characters."""
    budget = _TOKENIZER_TRAIN_CHARS
    with open(train_jsonl, encoding="utf-8") as file:
        for record in file:
            for line in json.loads(record)["text"].split("\n"):
                if line.strip():
                    yield line
                    budget -= len(line)
                    if budget <= 0:
                        return


def _name_hash(name: str) -> str:
    """Stable pseudo-random sort key for a document name."""
    return hashlib.sha1(name.encode()).hexdigest()
