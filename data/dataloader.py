"""Stateful, data-parallel-invariant loader over the global stream of packed sequences.

Layout never changes the math: the global batch of step k is the global sequences
`[pos_k, pos_k + B*dp)` where `pos_k` is the number of sequences consumed before it and `B*dp`
the global batch size. Data-parallel rank r takes every dp-th of them, i.e. sequence
`pos_k + j*dp + r` as row j of its local batch, so the ranks' batches are disjoint and their
union is the dp=1 global batch whatever dp is.

State (`state_dict()`) is the *global* position and is identical on every rank::

    {"version": 1, "consumed_sequences": int, "seq_len": int, "dataset": str,
     "cursor": dict, "dp_degree": int, "local_batch_size": int}

With `documents=True` each item is (input_ids, labels, documents): `documents[b, t]` is the
index, within row b, of the document token t belongs to (0 for the row's first document), from
the sources' document boundaries (a token file's index, a stream's packing), not from the tokens.

`cursor` lets a streamed source resume without re-reading (file sources need only the
position); `dp_degree` and `local_batch_size` are informational. A state saved at any dp degree
can be loaded at any other: the loader simply continues at `consumed_sequences`, so no sequence
is repeated or skipped. `load_state_dict` also accepts a mapping of per-rank states (e.g.
`{"dp_rank_0": s0, "dp_rank_1": s1, ...}` from a checkpoint that stored one per rank); they must
be identical and any one of them is used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from data.cache import default_cache_dir
from data.dataset import (
    EndOfEpoch,
    PackedTokens,
    SequenceSource,
    ShardedStream,
    StreamedTokens,
    cached_token_file,
    file_identity,
    merge_cursors,
)
from data.indexed import TokenStream, open_indexed, read_meta, resolve_prefixes
from data.mixture import MixtureSource, parse_mixture
from data.sample_corpus import ensure_sample_corpus
from data.sources import FILE_EXTENSIONS, iter_documents, open_hf_stream, resolve_files
from data.tokenizer import Tokenizer, build_tokenizer

logger = logging.getLogger("meshtrain")

SUPPORTED_DATASETS = ("sample", "text", "jsonl", "parquet", "huggingface", "megatron")
STATE_VERSION = 1

Batch = tuple[torch.Tensor, ...]  # (inputs, labels) or (inputs, labels, documents)


class DPDataLoader:
    """Yields (input_ids, labels) local batches of the global stream; exactly resumable.

    Infinite loaders loop over epochs forever and a new `iter()` continues where the last one
    stopped. Finite loaders (validation) make one pass, dropping the last incomplete global
    batch, and every new `iter()` starts again from the beginning (or from a just-loaded state).
    """

    def __init__(
        self,
        source: SequenceSource,
        *,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        infinite: bool,
        documents: bool = False,
        gather_cursors: Callable[[dict], list[dict]] | None = None,
    ) -> None:
        self.source = source
        self.gather_cursors = gather_cursors  # every DP rank's cursor (sharded streams)
        self.documents = documents
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.infinite = infinite
        self._reader = source.reader(0, {}, infinite)
        self._resumed = False

    def __iter__(self) -> Iterator[Batch]:
        if not self.infinite and not self._resumed:
            self._reader = self.source.reader(0, {}, False)
        self._resumed = False
        while (batch := self._next_batch()) is not None:
            yield batch
        self._reader = self.source.reader(0, {}, self.infinite)  # finite pass done: rewind

    def _next_batch(self) -> Batch | None:
        """This rank's rows of the next global batch; None when a finite pass ends. The reader
        reaches them as its source allows: a random-access source or a sharded stream reads
        only this rank's rows (the cost per rank does not grow with DP), one stream walks
        through every row of the global batch."""
        size = self.local_batch_size * self.dp_degree
        start = self._reader.position
        try:
            rows = self._reader.read_rows(
                range(start + self.dp_rank, start + size, self.dp_degree), start + size
            )
        except EndOfEpoch:
            return None
        sequences = torch.from_numpy(np.stack([tokens for tokens, _ in rows]).astype(np.int64))
        inputs, labels = sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous()
        if not self.documents:
            return inputs, labels
        starts = np.zeros(inputs.shape, dtype=np.int32)
        for row, (_, within) in enumerate(rows):
            starts[row, within] = 1
        return inputs, labels, torch.from_numpy(np.cumsum(starts, axis=1, dtype=np.int32))

    def source_tokens(self) -> dict[str, int]:
        """A mixture's input tokens taken from each source so far, over all ranks
        (`tokens_mix<i>`); {} for a single dataset."""
        counts = getattr(self._reader, "source_sequences", dict)()
        return {f"tokens_{label}": n * self.source.seq_len for label, n in counts.items()}

    def state_dict(self) -> dict[str, Any]:
        """The global position (the same on every rank). A sharded stream's cursor joins every
        data-parallel rank's shard cursors (`gather_cursors`, a collective over the DP ranks:
        every rank calls it together, as a checkpoint save does)."""
        cursor = self._reader.cursor()
        if "shards" in cursor and self.gather_cursors is not None:
            cursor = merge_cursors(self.gather_cursors(cursor))
        return {
            "version": STATE_VERSION,
            "consumed_sequences": self._reader.position,
            "seq_len": self.source.seq_len,
            "dataset": self.source.fingerprint,
            "cursor": cursor,
            "dp_degree": self.dp_degree,
            "local_batch_size": self.local_batch_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved global position (saved at any dp degree)."""
        state = _single_state(state)
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state version {state.get('version')!r} is not supported")
        if state["seq_len"] != self.source.seq_len:
            raise ValueError(
                f"data loader state was saved with seq_len={state['seq_len']} but this loader "
                f"uses seq_len={self.source.seq_len}; positions are counted in sequences, so "
                "resume with the same seq_len"
            )
        if state["dataset"] != self.source.fingerprint:
            logger.warning(
                "data loader state was saved for dataset %s but this loader reads %s; "
                "resuming at sequence %d anyway",
                state["dataset"],
                self.source.fingerprint,
                state["consumed_sequences"],
            )
        cursor = dict(state.get("cursor") or {})
        self._reader = self.source.reader(state["consumed_sequences"], cursor, self.infinite)
        self._resumed = True


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str,
    tokenizer: Tokenizer | str,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    split: str = "train",
    text_field: str = "text",
    cache_dir: str | None = None,
    infinite: bool = True,
    documents: bool = False,
    shuffle_seed: int | None = None,
    mixture: list[str] | None = None,
    stream_shards: int = 1,
    gather_cursors: Callable[[dict], list[dict]] | None = None,
) -> DPDataLoader:
    """Returns an iterable with state_dict()/load_state_dict(); each item is (input_ids, labels),
    both torch.long tensors of shape [local_batch_size, seq_len] (on CPU), and with `documents`
    their document indices (int32, same shape; see DPDataLoader). `shuffle_seed`: read each
    epoch's sequences in that seed's order (`data/shuffle.py`); sources without random access
    (streamed datasets) refuse it. `mixture`: `KIND:PATH:WEIGHT` entries blended by weight
    (`data/mixture.py`) instead of `dataset`/`dataset_path`; source i is shuffled with
    `shuffle_seed + i`. `dataset` is one of SUPPORTED_DATASETS; "megatron" reads pre-tokenised
    indexed datasets (`dataset_path`: prefixes, .idx files, folders or globs, comma-separated).
    For "sample" `dataset_path` is ignored and `split` ("train"/"validation") picks the part; for
    "huggingface" `split` is the HF split; for local files it is ignored. `tokenizer` may be
    a Tokenizer or a tokenizer file path.

    `stream_shards` > 1: a streamed training source in virtual shards (`sharded_stream`);
    `gather_cursors` all-gathers a cursor over the data-parallel ranks (for its state)."""
    _check_batch_shape(seq_len, local_batch_size, dp_rank, dp_degree)
    if isinstance(tokenizer, str):
        tokenizer = build_tokenizer(tokenizer)
    if stream_shards > 1:
        _check_sharded_stream(dataset, mixture, infinite)
        source = sharded_stream(
            dataset_path, tokenizer, seq_len, split, text_field, stream_shards, dp_degree
        )
    else:
        build = functools.partial(
            build_source, tokenizer=tokenizer, seq_len=seq_len, split=split,
            text_field=text_field, cache_dir=cache_dir or default_cache_dir(),
        )  # fmt: skip
        source = _source(build, dataset, dataset_path, mixture, shuffle_seed)
    _warn_of_loader_problems(source, infinite, local_batch_size, dp_degree)
    return DPDataLoader(
        source,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        infinite=infinite,
        documents=documents,
        gather_cursors=gather_cursors,
    )


def _check_batch_shape(seq_len: int, local_batch_size: int, dp_rank: int, dp_degree: int):
    for label, value in [("seq_len", seq_len), ("local_batch_size", local_batch_size)]:
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    if dp_degree < 1 or not 0 <= dp_rank < dp_degree:
        raise ValueError(
            f"need dp_degree >= 1 and 0 <= dp_rank < dp_degree, got {dp_rank=}, {dp_degree=}"
        )


def _check_sharded_stream(dataset: str, mixture: list[str] | None, infinite: bool) -> None:
    if mixture or dataset != "huggingface" or not infinite:
        raise ValueError(
            "stream_shards > 1 splits a streamed training dataset (dataset = 'huggingface',"
            " no mixture, infinite); this loader reads "
            + ("a mixture" if mixture else f"{dataset!r}" + ("" if infinite else " once"))
        )


def _source(build: Callable, dataset: str, path: str, mixture: list[str] | None, shuffle_seed):
    """The mixture's blend, else the one dataset, each shuffled with `shuffle_seed` if given."""
    if mixture:
        return _mixture(mixture, build, shuffle_seed)
    return _shuffle(build(dataset=dataset, dataset_path=path), shuffle_seed)


def _mixture(mixture: list[str], build: Callable, shuffle_seed: int | None) -> MixtureSource:
    """`KIND:PATH:WEIGHT` entries blended by weight, source i shuffled with shuffle_seed + i."""
    entries = parse_mixture(mixture)
    parts = [build(dataset=kind, dataset_path=path) for kind, path, _ in entries]
    for i, part in enumerate(parts):
        _shuffle(part, None if shuffle_seed is None else shuffle_seed + i)
    labels = [f"mix{i}" for i in range(len(parts))]
    return MixtureSource(parts, [w for *_, w in entries], labels)


def _warn_of_loader_problems(source, infinite: bool, local_batch_size: int, dp_degree: int):
    """A finite pass with no whole global batch; one stream read whole by several ranks."""
    global_batch = local_batch_size * dp_degree
    if not infinite and isinstance(source, PackedTokens) and source.num_sequences < global_batch:
        logger.warning(
            "%s holds %d sequences of seq_len=%d, fewer than one global batch (%d x dp %d): "
            "a pass over it yields no batches; use a smaller batch or seq_len",
            source.name,
            source.num_sequences,
            source.seq_len,
            local_batch_size,
            dp_degree,
        )
    if isinstance(source, StreamedTokens) and dp_degree > 1:
        logger.warning(
            "%s is one stream: each of the %d data-parallel ranks reads and tokenises every "
            "row of the global batch, a cost that grows with the DP degree; set "
            "training.stream_shards to a multiple of it (at most the dataset's file count)",
            source.name,
            dp_degree,
        )


def build_source(
    *,
    dataset: str,
    dataset_path: str,
    tokenizer: Tokenizer,
    seq_len: int,
    split: str,
    text_field: str,
    cache_dir: str,
) -> SequenceSource:
    """The global sequence stream of a dataset (tokenised into the cache for file sources)."""
    if dataset == "sample":
        if split not in ("train", "validation"):
            raise ValueError(f"sample dataset split must be 'train' or 'validation', got {split!r}")
        train, validation = ensure_sample_corpus(cache_dir)
        files = [train if split == "train" else validation]
        return _packed_files(
            "jsonl", files, "text", tokenizer, seq_len, cache_dir, f"sample/{split}"
        )
    if dataset in FILE_EXTENSIONS:
        files = resolve_files(dataset, dataset_path)
        name = f"{dataset}:{dataset_path}"
        return _packed_files(dataset, files, text_field, tokenizer, seq_len, cache_dir, name)
    if dataset == "megatron":
        return indexed_corpus(dataset_path, tokenizer, seq_len)
    if dataset == "huggingface":
        if not dataset_path:
            raise ValueError("dataset 'huggingface' needs dataset_path: a hub name or local folder")
        (open_documents,) = open_hf_stream(dataset_path, split, text_field)
        next(open_documents(0), None)  # fail now, not mid-training, on a missing text field
        name = f"huggingface:{dataset_path}:{split}"
        fingerprint = f"{name}:{text_field}:{tokenizer.fingerprint[:16]}"
        return StreamedTokens(open_documents, tokenizer, seq_len, name, fingerprint)
    raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(SUPPORTED_DATASETS)}")


def sharded_stream(
    dataset_path: str,
    tokenizer: Tokenizer,
    seq_len: int,
    split: str,
    text_field: str,
    num_shards: int,
    dp_degree: int,
) -> ShardedStream:
    """A Hugging Face dataset streamed as `num_shards` virtual shards of its data files."""
    if not dataset_path:
        raise ValueError("dataset 'huggingface' needs dataset_path: a hub name or local folder")
    openers = open_hf_stream(dataset_path, split, text_field, num_shards)
    next(openers[0](0), None)  # fail now, not mid-training, on a missing text field
    name = f"huggingface:{dataset_path}:{split}"
    fingerprint = f"{name}:{text_field}:{tokenizer.fingerprint[:16]}:shards{num_shards}"
    shards = [
        StreamedTokens(opener, tokenizer, seq_len, f"{name} shard {k}", fingerprint)
        for k, opener in enumerate(openers)
    ]
    if num_shards % dp_degree:
        logger.warning(
            "training.stream_shards = %d is not a multiple of the data-parallel degree %d: a "
            "rank's rows come from shards that other ranks read too, and it tokenises their "
            "rows as well (up to %dx its own)",
            num_shards,
            dp_degree,
            max(1, dp_degree // math.gcd(num_shards, dp_degree)),
        )
    return ShardedStream(shards, seq_len, name, fingerprint)


def _packed_files(
    kind: str,
    files: list[str],
    text_field: str,
    tokenizer: Tokenizer,
    seq_len: int,
    cache_dir: str,
    name: str,
) -> PackedTokens:
    """Tokenise local files once (cached) and view them as packed sequences."""
    identity = {
        "kind": kind,
        "files": file_identity(files),
        "text_field": None if kind == "text" else text_field,
    }
    tokens, key = cached_token_file(
        documents=lambda: iter_documents(kind, files, text_field),
        identity=identity,
        tokenizer=tokenizer,
        cache_dir=cache_dir,
        name=name,
        input_bytes=sum(size for _, size, _ in identity["files"]),
    )
    return PackedTokens(tokens, seq_len, name, fingerprint=f"{name}:{key}")


def _shuffle(source: SequenceSource, seed: int | None) -> SequenceSource:
    """The source, set to read its epochs in the seed's order (None: in corpus order)."""
    if seed is None:
        return source
    if not isinstance(source, PackedTokens):
        raise ValueError(
            f"{source.name} is streamed, so its sequences cannot be read in a shuffled "
            "order; set training.shuffle = false for it"
        )
    source.shuffle_seed = seed
    source.fingerprint += f":shuffle{seed}"
    return source


def indexed_corpus(dataset_path: str, tokenizer: Tokenizer, seq_len: int) -> PackedTokens:
    """Pre-tokenised Megatron indexed datasets, memory-mapped and read as one stream in the
    order `resolve_prefixes` gives. A corpus whose `.meta.json` names another tokenizer is
    refused; one without (Megatron's own tools write none) is checked window by window against
    the vocabulary (`PackedTokens.vocab_size`)."""
    prefixes = resolve_prefixes(dataset_path)
    files = []
    for prefix in prefixes:
        meta = read_meta(prefix)
        if meta is not None and meta.get("tokenizer") not in (None, tokenizer.fingerprint):
            raise ValueError(
                f"{prefix} was tokenised with tokenizer {meta['tokenizer'][:16]}, not this run's "
                f"{tokenizer.path} ({tokenizer.fingerprint[:16]}); set model.tokenizer_path to "
                "the corpus' tokenizer or re-tokenise the corpus"
            )
        files.append(open_indexed(prefix))
    tokens = TokenStream([f.tokens for f in files], [f.doc_starts for f in files])
    identity = [[p, os.path.getsize(f"{p}.bin")] for p in prefixes]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    name = f"megatron:{dataset_path}"
    return PackedTokens(tokens, seq_len, name, f"{name}:{key}", vocab_size=tokenizer.vocab_size)


def _single_state(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """Return the loader state, collapsing a mapping of identical per-rank states into one."""
    if "consumed_sequences" in state:
        return state
    per_rank = list(state.values())
    if per_rank and all(isinstance(s, Mapping) and "consumed_sequences" in s for s in per_rank):
        if all("shards" in (s.get("cursor") or {}) for s in per_rank):  # a sharded stream's
            merged = merge_cursors([s["cursor"] for s in per_rank])
            per_rank = [{**s, "cursor": merged} for s in per_rank]
        if any(dict(s) != dict(per_rank[0]) for s in per_rank):
            raise ValueError(
                "per-rank data loader states differ; they should all hold the same global position"
            )
        return per_rank[0]
    raise ValueError(f"not a data loader state (keys: {sorted(state)})")
