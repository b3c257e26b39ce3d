"""The global stream of packed sequences, and readers that walk it from any position.

Stream definition (the same for every source and every data-parallel layout):

- documents are tokenised in source order as `[BOS] + tokens + [EOS]` (no BOS when the
  tokenizer has none, as Qwen's; empty documents are skipped) and concatenated into one token
  stream per epoch;
- sequence `i` of an epoch is `stream[i*L : i*L + L + 1]` with `L = seq_len`; the model input is
  its first `L` tokens and the labels its last `L`. Consecutive sequences overlap by exactly one
  token (the last label of sequence i is the first input of sequence i+1), so every token after
  the first is predicted exactly once per epoch. Trailing tokens that do not fill a sequence
  are dropped;
- epochs repeat the same stream; global sequence index `g` runs on across epochs;
- with a shuffle seed (random-access sources: token files), position `i` of epoch `e` reads
  sequence `permuted(i, count, seed, e)` instead of sequence `i` (`data/shuffle.py`).

File sources are tokenised once into the cache as a Megatron indexed dataset
(`tokens/<key>.bin` + `.idx`, uint16 when the vocabulary fits, else int32, one document per
sequence, plus `<key>.meta.json`; the key hashes the files' paths/sizes/mtimes, the text field
and the tokenizer) that is memory-mapped, so sequence `g` is an O(1) slice; pre-tokenised Megatron
corpora (`data/indexed.py`) are read the same way, from many files. Streaming Hugging Face
datasets are tokenised on the fly by every rank.

Document boundaries travel with the tokens: a reader's `advance` returns, with a kept window, the
window-relative offsets of the documents that start inside it (from the index for token files, from
the packing for streams), so document masking needs no end-of-document token
(`data.dataloader.DPDataLoader(documents=True)`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from data.cache import build_once
from data.indexed import TokenStream, open_indexed, token_dtype, write_indexed
from data.readers import WalkingReader, random_access_rows
from data.shuffle import permuted
from data.tokenizer import Tokenizer

logger = logging.getLogger("meshtrain")

_TOKEN_CACHE_VERSION = 2  # 2: Megatron indexed format with document boundaries
_ENCODE_BATCH = 256  # documents per tokenizer call while building a token file


class EndOfEpoch(Exception):
    """Raised by a finite reader when its single epoch is exhausted."""


# A kept sequence: its L+1 tokens, and the offsets (in 1..L-1, ascending) at which a document
# starts inside its first L tokens (the inputs).
Window = tuple[np.ndarray, np.ndarray]


class SequenceReader(Protocol):
    """A cursor over the global sequence stream."""

    position: int  # global index of the next sequence

    def advance(self, keep: bool) -> Window | None:
        """Move past the next sequence, returning its window if `keep`."""
        ...

    def read_rows(self, rows: range, end: int) -> list[Window]:
        """The windows of global sequences `rows` (ascending, in [position, end)); then the
        position is `end`. EndOfEpoch where a finite pass ends first. Each reader reaches
        the rows as cheaply as its source allows (random access, walking, one shard each)."""
        ...

    def cursor(self) -> dict[str, Any]:
        """Source-specific resume information for `position` (identical on all ranks)."""
        ...


class SequenceSource(Protocol):
    """Something that can open readers over its global sequence stream."""

    name: str
    fingerprint: str
    seq_len: int

    def reader(self, position: int, cursor: dict[str, Any], infinite: bool) -> SequenceReader:
        """A reader positioned at global sequence `position`."""
        ...


# ---------------------------------------------------------------------------- file sources


def cached_token_file(
    *,
    documents: Callable[[], Iterable[str]],
    identity: dict[str, Any],
    tokenizer: Tokenizer,
    cache_dir: str,
    name: str,
    input_bytes: int = 0,
) -> tuple[TokenStream, str]:
    """Tokenise the documents into the cache once, as a Megatron indexed dataset; return
    (its memory-mapped token stream with document boundaries, cache key).

    Inputs of PARALLEL_BYTES or more are tokenised by a pool of one process per core (batches
    of documents in order, so the file is the same as one process writes); progress is logged
    every PROGRESS_S seconds; above PIPELINE_BYTES the log points to scripts/pretokenize.py."""
    identity = {"version": _TOKEN_CACHE_VERSION, "tokenizer": tokenizer.fingerprint, **identity}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    prefix = Path(cache_dir) / "tokens" / key
    targets = [Path(f"{prefix}{suffix}") for suffix in (".bin", ".idx", ".meta.json")]
    dtype = token_dtype(tokenizer.vocab_size)

    def encoded() -> Iterator[np.ndarray]:
        docs = (doc for doc in documents() if doc)
        batches = iter(lambda: list(islice(docs, _ENCODE_BATCH)), [])
        workers = len(os.sched_getaffinity(0)) if input_bytes >= PARALLEL_BYTES else 1
        progress = _Progress(name, input_bytes, workers)
        if workers == 1:
            encoded_batches = (tokenizer.encode_batch(b, True, True) for b in batches)
            for ids in encoded_batches:
                yield from progress.count(np.asarray(i, dtype=dtype) for i in ids)
            return
        context = multiprocessing.get_context("spawn")  # no fork of a rank's threads
        with context.Pool(workers, _init_worker, (tokenizer.path,)) as pool:
            for ids in pool.imap(_encode_worker, batches, chunksize=4):
                yield from progress.count(np.asarray(i, dtype=dtype) for i in ids)

    def build(temps: list[Path]) -> None:
        logger.info("tokenising %s into %s (once; other ranks wait)", name, targets[0])
        if input_bytes >= PIPELINE_BYTES:
            logger.warning(
                "%s holds %.1f GB of text: tokenising it at start-up takes long and is redone "
                "whenever the files change; pre-tokenise it once with scripts/pretokenize.py "
                "(all cores or a SLURM job array) and train on the output with "
                "training.dataset = 'megatron'",
                name,
                input_bytes / 1e9,
            )
        num_docs, num_tokens = write_indexed(temps[0], temps[1], encoded(), dtype)
        if num_tokens == 0:
            raise ValueError(f"{name} contains no non-empty documents")
        meta = {"num_tokens": num_tokens, "num_docs": num_docs, "tokenizer": tokenizer.fingerprint}
        temps[2].write_text(json.dumps({**meta, "identity": identity}, indent=1))
        logger.info("tokenised %s: %d documents, %d tokens", name, num_docs, num_tokens)

    build_once(targets, build)
    file = open_indexed(str(prefix))
    return TokenStream([file.tokens], [file.doc_starts]), key


PARALLEL_BYTES = 16 * 2**20  # first-use tokenisation of at least this much text uses every core
PIPELINE_BYTES = 2 * 2**30  # above this much text the log points to the pipeline
PROGRESS_S = 10.0
_WORKER_TOKENIZER: list[Tokenizer] = []


def _init_worker(path: str) -> None:
    from data.tokenizer import build_tokenizer

    _WORKER_TOKENIZER[:] = [build_tokenizer(path)]


def _encode_worker(batch: list[str]) -> list[list[int]]:
    return _WORKER_TOKENIZER[0].encode_batch(batch, True, True, threads=1)  # one per core


class _Progress:
    """Logs documents and tokens done (and the input's size) every PROGRESS_S seconds."""

    def __init__(self, name: str, input_bytes: int, workers: int) -> None:
        self.name, self.input_bytes, self.workers = name, input_bytes, workers
        self.docs = self.tokens = 0
        self.start = self.last = time.monotonic()

    def count(self, arrays: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        for array in arrays:
            self.docs += 1
            self.tokens += len(array)
            yield array
        now = time.monotonic()
        if now - self.last >= PROGRESS_S:
            self.last = now
            logger.info(
                "tokenising %s (%d processes, %.0f MB of text): %d documents, %d tokens, "
                "%.0f tokens/s",
                self.name,
                self.workers,
                self.input_bytes / 1e6,
                self.docs,
                self.tokens,
                self.tokens / (now - self.start),
            )


def file_identity(files: list[str]) -> list[list[Any]]:
    """(path, size, mtime) of each file: cheap change detection for cache keys."""
    stats = [os.stat(f) for f in files]
    return [[f, st.st_size, st.st_mtime_ns] for f, st in zip(files, stats)]


@dataclass
class PackedTokens:
    """A tokenised epoch held as one token stream; sequence i is an O(1) slice."""

    tokens: TokenStream
    seq_len: int
    name: str
    fingerprint: str
    vocab_size: int | None = None  # set: every kept window is checked to lie below it
    shuffle_seed: int | None = None  # set: each epoch reads its sequences in a seeded order

    def __post_init__(self) -> None:
        self.num_sequences = (len(self.tokens) - 1) // self.seq_len
        if self.num_sequences < 1:
            raise ValueError(
                f"{self.name} has only {len(self.tokens)} tokens, fewer than seq_len + 1 = "
                f"{self.seq_len + 1}; use a smaller seq_len or more data"
            )

    random_access = True  # window(g) of any g in O(1): a DP rank reads only its own rows

    def reader(self, position: int, cursor: dict[str, Any], infinite: bool) -> PositionReader:
        """A reader at global sequence `position` (no cursor needed: access is random)."""
        return PositionReader(self, position, infinite)

    def window(self, position: int, infinite: bool) -> Window:
        """Global sequence `position`; EndOfEpoch past epoch 0 if not `infinite`."""
        epoch, index = divmod(position, self.num_sequences)
        if epoch > 0 and not infinite:
            raise EndOfEpoch
        if index == 0 and epoch > 0:
            logger.info("dataset %s: starting epoch %d", self.name, epoch)
        if self.shuffle_seed is not None:
            index = permuted(index, self.num_sequences, self.shuffle_seed, epoch)
        start = index * self.seq_len
        window = self.tokens.slice(start, start + self.seq_len + 1)
        vocab = self.vocab_size
        if vocab is not None and len(window) and (window.max() >= vocab or window.min() < 0):
            raise ValueError(
                f"{self.name}: sequence {index} holds token ids outside the tokenizer's "
                f"vocabulary [0, {vocab}); the corpus was tokenised with another tokenizer"
            )
        return window, self.tokens.starts_within(start, start + self.seq_len)


class PositionReader:
    """Walks the global stream of a random-access source (`window(g)`): the position is all
    its state."""

    def __init__(self, source: Any, position: int, infinite: bool) -> None:
        self.source, self.position, self.infinite = source, position, infinite

    def read_rows(self, rows: range, end: int) -> list[Window]:
        return random_access_rows(self, self.source, rows, end)

    def advance(self, keep: bool) -> Window | None:
        """Move past global sequence `position`; raise EndOfEpoch after epoch 0 if finite."""
        window = self.source.window(self.position, self.infinite) if keep else None
        if not keep and not self.infinite:
            self.source.window(self.position, False)  # raises at the end of epoch 0
        self.position += 1
        return window

    def cursor(self) -> dict[str, Any]:
        """Nothing beyond the position."""
        return {}


# ----------------------------------------------------------------------- streaming sources


@dataclass
class StreamedTokens:
    """A streamed document source packed on the fly (every rank tokenises every document)."""

    open_documents: Callable[[int], Iterator[str]]  # iterator after skipping n documents
    tokenizer: Tokenizer
    seq_len: int
    name: str
    fingerprint: str

    def reader(self, position: int, cursor: dict[str, Any], infinite: bool) -> StreamReader:
        """A reader at `position`; `cursor` (from StreamReader.cursor) avoids re-tokenising."""
        return StreamReader(self, position, cursor, infinite)


class StreamReader(WalkingReader):
    """Packs a document stream into sequences, keeping a resumable cursor.

    The cursor names the epoch, the global index where it started, and the document holding
    the next sequence's first token (its index and epoch-relative token offset), so a resumed
    reader skips straight to that document.
    """

    def __init__(
        self, source: StreamedTokens, position: int, cursor: dict[str, Any], infinite: bool
    ) -> None:
        self.source, self.position, self.infinite = source, position, infinite
        if "shards" in cursor:
            raise ValueError(
                f"the loader state of {source.name} was saved reading it as "
                f"{cursor.get('count')} stream shards; the shard count is part of the data "
                f"order, so resume with training.stream_shards = {cursor.get('count')}"
            )
        if "doc_index" in cursor:
            self.epoch, self.epoch_start = cursor["epoch"], cursor["epoch_start"]
            doc, doc_start = cursor["doc_index"], cursor["doc_token_start"]
        elif position == 0:
            self.epoch, self.epoch_start, doc, doc_start = 0, 0, 0, 0
        else:
            raise ValueError(
                f"resuming streamed dataset {source.name} at sequence {position} needs the "
                "'cursor' saved with the loader state"
            )
        self._open(doc, doc_start)

    def _open(self, doc: int, doc_start: int) -> None:
        """Restart reading at document `doc`, whose first token has offset `doc_start`."""
        self._docs = self.source.open_documents(doc)
        self._next_doc = doc
        self._buffer = np.zeros(0, dtype=np.int64)
        self._buffer_start = doc_start  # epoch-relative offset of _buffer[0]
        self._doc_starts: list[tuple[int, int]] = []  # (doc index, offset) of buffered docs

    def _fill(self, end: int) -> bool:
        """Read documents until the buffer reaches token offset `end`; False if exhausted."""
        chunks = [self._buffer]
        buffered_end = self._buffer_start + len(self._buffer)
        while buffered_end < end:
            text = next(self._docs, None)
            if text is None:
                self._buffer = np.concatenate(chunks)
                return False
            if text:
                ids = self.source.tokenizer.encode(text, bos=True, eos=True)
                self._doc_starts.append((self._next_doc, buffered_end))
                chunks.append(np.asarray(ids, dtype=np.int64))
                buffered_end += len(ids)
            self._next_doc += 1
        self._buffer = np.concatenate(chunks)
        return True

    def advance(self, keep: bool) -> Window | None:
        """Move past global sequence `position`, wrapping (or ending) at the stream's end."""
        seq_len = self.source.seq_len
        start = (self.position - self.epoch_start) * seq_len
        if not self._fill(start + seq_len + 1):
            if not self.infinite:
                raise EndOfEpoch
            if self.position == self.epoch_start:
                raise ValueError(
                    f"{self.source.name} yields fewer than seq_len + 1 = {seq_len + 1} tokens "
                    "per epoch; use a smaller seq_len or more data"
                )
            self.epoch, self.epoch_start = self.epoch + 1, self.position
            logger.info("dataset %s: starting epoch %d", self.source.name, self.epoch)
            self._open(0, 0)
            return self.advance(keep)
        offset = start - self._buffer_start
        window = None
        if keep:
            starts = [s - start for _, s in self._doc_starts if start < s < start + seq_len]
            window = (
                self._buffer[offset : offset + seq_len + 1].copy(),
                np.asarray(starts, dtype=np.int64),
            )
        self.position += 1
        self._drop_before(start + seq_len)
        return window

    def _drop_before(self, offset: int) -> None:
        """Forget tokens and documents wholly before epoch-relative token `offset`."""
        self._buffer = self._buffer[offset - self._buffer_start :]
        self._buffer_start = offset
        while len(self._doc_starts) > 1 and self._doc_starts[1][1] <= offset:
            self._doc_starts.pop(0)

    def cursor(self) -> dict[str, Any]:
        """Resume point for `position`: the document holding its first token."""
        if self._doc_starts:
            doc, doc_start = self._doc_starts[0]
        else:  # nothing buffered: the next document to read starts the next sequence
            doc, doc_start = self._next_doc, self._buffer_start + len(self._buffer)
        return {
            "epoch": self.epoch,
            "epoch_start": self.epoch_start,
            "doc_index": doc,
            "doc_token_start": doc_start,
        }


@dataclass
class ShardedStream:
    """A streamed source split into S virtual shards, each packed on its own: global sequence g
    is sequence g // S of shard g % S. The order depends on S, never on the layout. When the
    data-parallel degree divides S, every sequence of shard k goes to rank k % dp, so a rank
    opens and tokenises only its S / dp shards: its cost per step is its own rows, whatever
    the degree (`DPDataLoader` skips the rows of other ranks without touching their shards)."""

    shards: list[StreamedTokens]
    seq_len: int
    name: str
    fingerprint: str

    def reader(self, position: int, cursor: dict[str, Any], infinite: bool) -> ShardedReader:
        """A reader at global `position`; `cursor["shards"]` holds the saved shards' cursors."""
        if not infinite:
            raise ValueError(
                f"{self.name}: a sharded stream has no common end of epoch across ranks, so it "
                "cannot make one finite pass (validation reads it as one stream)"
            )
        saved = cursor.get("count", 1) if cursor else len(self.shards)
        if position and saved != len(self.shards):
            raise ValueError(
                f"{self.name}: the loader state was saved reading {saved} stream shard(s), this "
                f"run reads {len(self.shards)}; the shard count is part of the data order, so "
                f"resume with training.stream_shards = {saved}"
            )
        return ShardedReader(self, position, cursor.get("shards", {}))


class ShardedReader:
    """Walks a ShardedStream: `advance(keep=False)` costs nothing; a kept row opens its shard's
    reader (at the shard's saved cursor, else from its start) and catches it up."""

    def __init__(self, source: ShardedStream, position: int, cursors: dict[str, Any]) -> None:
        self.source, self.position = source, position
        self._saved = dict(cursors)  # str(shard) -> {"position": shard position, **cursor}
        self._readers: dict[int, StreamReader] = {}

    def _shard_reader(self, shard: int) -> StreamReader:
        if shard not in self._readers:
            saved = dict(self._saved.get(str(shard), {}))
            at = saved.pop("position", 0)
            if at and not saved:
                raise ValueError(f"{self.source.name}: shard {shard}'s saved cursor is empty")
            self._readers[shard] = StreamReader(self.source.shards[shard], at, saved, True)
        return self._readers[shard]

    def advance(self, keep: bool) -> Window | None:
        """Move past global sequence `position`, reading it from its shard if `keep`."""
        count = len(self.source.shards)
        shard, index = self.position % count, self.position // count
        window = None
        if keep:
            reader = self._shard_reader(shard)
            if reader.position > index:
                raise ValueError(
                    f"{self.source.name}: shard {shard} was saved past sequence {index}; "
                    "the loader state does not match this position"
                )
            while reader.position < index:  # rows of this shard that other ranks kept
                reader.advance(False)
            window = reader.advance(True)
        self.position += 1
        return window

    def read_rows(self, rows: range, end: int) -> list[Window]:
        """The windows of global sequences `rows` (ascending, from `position` on); then the
        position moves to `end`. The rows in between cost nothing."""
        windows = []
        for row in rows:
            self.position = row
            windows.append(self.advance(True))
        self.position = end
        return windows

    def cursor(self) -> dict[str, Any]:
        """The cursors of the shards this reader opened (other ranks hold the others';
        `merge_cursors` joins them) and any saved ones it has not opened yet."""
        shards = dict(self._saved)
        for shard, reader in self._readers.items():
            shards[str(shard)] = {"position": reader.position, **reader.cursor()}
        return {"count": len(self.source.shards), "shards": shards}


def merge_cursors(cursors: list[dict[str, Any]]) -> dict[str, Any]:
    """One cursor from every data-parallel rank's: each shard's most advanced position."""
    (count,) = {cursor["count"] for cursor in cursors}
    shards: dict[str, Any] = {}
    for cursor in cursors:
        for shard, saved in cursor.get("shards", {}).items():
            if saved["position"] >= shards.get(shard, {"position": -1})["position"]:
                shards[shard] = saved
    return {"count": count, "shards": shards}
