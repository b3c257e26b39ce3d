"""Pre-tokenised corpora in Megatron-LM's indexed format, read by memory map.

A Megatron indexed dataset is a pair of files sharing a prefix:

- `<prefix>.bin`: the token ids of every sequence, back to back, in one numeric dtype;
- `<prefix>.idx`: little-endian, in order: the magic bytes `MMIDIDX\\x00\\x00` (9), the version
  (uint64, 1), the dtype code (uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
  7 float32, 8 uint16), the sequence count S and the document-index count D (uint64 each),
  then S int32 sequence lengths (tokens), S int64 sequence pointers (byte offsets into the
  .bin), and D int64 document indices: the sequence index at which each document starts,
  from 0 up to S (so D - 1 documents; a document may hold several sequences, e.g. sentences).
  A multimodal index appends S int8 sequence modes, which this reader ignores.

This is the format Megatron-LM's `tools/preprocess_data.py` writes, and the one meshtrain's own
token cache writes (`write_indexed`), so a corpus tokenised on first use and one tokenised
elsewhere are read by the same code. The reader holds only the document start offsets (8 bytes
per document) in memory; tokens stay in the page cache.

An optional `<prefix>.meta.json` beside the pair records the tokenizer fingerprint the corpus was
written with (meshtrain's cache and pipeline write it; Megatron's tools do not): a corpus whose
fingerprint differs from the run's tokenizer is refused.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SUFFIXES = (".idx", ".bin")  # a path ending so names an indexed dataset (dataset "megatron")
MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices
_INTEGER_CODES = {1, 2, 3, 4, 5, 8}


def token_dtype(vocab_size: int) -> type[np.integer]:
    """The smallest dtype holding every id of the vocabulary (uint16 or int32, as Megatron)."""
    return np.uint16 if vocab_size <= 2**16 else np.int32


def write_indexed(
    bin_path: str | Path,
    idx_path: str | Path,
    documents: Iterable[np.ndarray],
    dtype: type[np.integer],
) -> tuple[int, int]:
    """Write documents (one 1-D token array each, one sequence per document) as a .bin and its
    .idx; returns (documents, tokens). Files are written in place: callers that need atomicity
    write to temporary names (`data.cache.build_once`)."""
    code = next(c for c, d in DTYPE_CODES.items() if np.dtype(d) == np.dtype(dtype))
    lengths: list[int] = []
    with open(bin_path, "wb") as out:
        for doc in documents:
            out.write(np.asarray(doc, dtype=dtype).tobytes())
            lengths.append(len(doc))
    write_index(idx_path, np.asarray(lengths, dtype=np.int64), code)
    return len(lengths), int(sum(lengths))


def write_index(path: str | Path, lengths: np.ndarray, code: int) -> None:
    """The .idx of contiguous sequences of these lengths, one document each."""
    itemsize = np.dtype(DTYPE_CODES[code]).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    doc_index = np.arange(len(lengths) + 1, dtype=np.int64)
    with open(path, "wb") as out:
        out.write(_HEADER.pack(MAGIC, VERSION, code, len(lengths), len(doc_index)))
        out.write(lengths.astype(np.int32).tobytes())
        out.write(pointers.tobytes())
        out.write(doc_index.tobytes())


@dataclass
class IndexedFile:
    """One memory-mapped .bin/.idx pair: its tokens and its documents' start offsets."""

    prefix: str
    tokens: np.ndarray  # memory map of the .bin, all its tokens
    doc_starts: np.ndarray  # int64 token offset of each document's first token (ascending)


def open_indexed(prefix: str) -> IndexedFile:
    """Memory-map `<prefix>.bin` by the layout its `<prefix>.idx` gives, checking the index."""
    idx_path, bin_path = f"{prefix}.idx", f"{prefix}.bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise ValueError(f"Megatron indexed dataset {prefix!r}: {path} does not exist")
    index = np.memmap(idx_path, dtype=np.uint8, mode="r")
    if len(index) < _HEADER.size:
        raise ValueError(f"{idx_path} is too short to be a Megatron index")
    magic, version, code, sequences, doc_indices = _HEADER.unpack(index[: _HEADER.size].tobytes())
    if magic != MAGIC or version != VERSION:
        raise ValueError(
            f"{idx_path} is not a Megatron indexed-dataset index (magic {magic!r}, version "
            f"{version}; expected {MAGIC!r}, {VERSION})"
        )
    if code not in _INTEGER_CODES:
        raise ValueError(f"{idx_path}: dtype code {code} is not an integer token type")
    dtype = np.dtype(DTYPE_CODES[code])
    offset = _HEADER.size
    need = offset + sequences * 12 + doc_indices * 8
    if len(index) < need:
        raise ValueError(f"{idx_path} holds {len(index)} bytes, its header announces {need}")
    lengths = np.frombuffer(index, np.int32, sequences, offset)
    pointers = np.frombuffer(index, np.int64, sequences, offset + 4 * sequences)
    doc_index = np.frombuffer(index, np.int64, doc_indices, offset + 12 * sequences)
    total = int(lengths.sum(dtype=np.int64))
    size = os.path.getsize(bin_path)
    if size != total * dtype.itemsize:
        raise ValueError(
            f"{bin_path} holds {size} bytes but its index describes {total} tokens of "
            f"{dtype.name} ({total * dtype.itemsize} bytes)"
        )
    # Sequences must lie back to back in index order, so that the corpus is one token stream.
    if sequences and (
        pointers[0] != 0
        or np.any(np.diff(pointers) != lengths[:-1].astype(np.int64) * dtype.itemsize)
    ):
        raise ValueError(
            f"{idx_path}: sequences are not stored back to back in index order; rewrite the "
            "corpus with Megatron's merge tool or meshtrain's pipeline"
        )
    if (
        len(doc_index) < 1
        or doc_index[0] != 0
        or doc_index[-1] != sequences
        or np.any(np.diff(doc_index) < 0)
    ):
        raise ValueError(
            f"{idx_path}: document indices must rise from 0 to the sequence count {sequences}"
        )
    tokens = np.memmap(bin_path, dtype=dtype, mode="r") if total else np.zeros(0, dtype)
    seq_starts = pointers // dtype.itemsize
    starts = seq_starts[doc_index[:-1][doc_index[:-1] < sequences]]  # ascending (checked)
    if len(starts) > 1:  # empty documents share their start with the next: keep one
        starts = starts[np.concatenate([[True], starts[1:] != starts[:-1]])]
    return IndexedFile(prefix, tokens, starts.astype(np.int64))


def read_meta(prefix: str) -> dict | None:
    """The `<prefix>.meta.json` record (tokenizer fingerprint, ...) if the corpus has one."""
    path = Path(f"{prefix}.meta.json")
    return json.loads(path.read_text()) if path.is_file() else None


def resolve_prefixes(path_spec: str) -> list[str]:
    """Expand a prefix, a .bin/.idx file, a folder (searched recursively) or a glob into the
    sorted prefixes of the indexed datasets it names; several may be given, comma-separated
    (read in the order given)."""
    prefixes: list[str] = []
    for spec in [s.strip() for s in path_spec.split(",") if s.strip()]:
        path = Path(spec).expanduser()
        if path.suffix in SUFFIXES and path.is_file():
            found = [str(path.with_suffix(""))]
        elif Path(f"{path}.idx").is_file():
            found = [str(path)]
        elif path.is_dir():
            found = sorted(str(p.with_suffix("")) for p in path.rglob("*.idx"))
        else:
            matches = glob.glob(spec if spec.endswith(".idx") else spec + ".idx", recursive=True)
            found = sorted(str(Path(p).with_suffix("")) for p in matches)
        if not found:
            raise ValueError(
                f"dataset_path {spec!r} names no Megatron indexed dataset; pass a prefix (the "
                "path without .bin/.idx), a .idx file, a folder of them or a glob"
            )
        prefixes += [str(Path(p).resolve()) for p in found]
    if not prefixes:
        raise ValueError("dataset 'megatron' needs dataset_path: a prefix, folder or glob")
    return prefixes


class TokenStream:
    """Several token arrays read as one: an O(log files) slice of any range, and the start
    offsets of every document (global token offsets, ascending)."""

    def __init__(self, parts: list[np.ndarray], doc_starts: list[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        sizes = [len(p) for p in parts]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.doc_starts = np.concatenate(
            [s + o for s, o in zip(doc_starts, self.offsets[:-1])] or [np.zeros(0, np.int64)]
        ).astype(np.int64)
        self._part_offsets = self.offsets[:-1][np.asarray(sizes) > 0]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) (a view when they lie in one part)."""
        first = int(np.searchsorted(self._part_offsets, start, side="right")) - 1
        pieces = []
        while start < stop:
            part, base = self.parts[first], int(self._part_offsets[first])
            end = min(stop, base + len(part))
            pieces.append(part[start - base : end - base])
            start, first = end, first + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def starts_within(self, start: int, stop: int) -> np.ndarray:
        """Offsets, relative to `start`, of the documents starting inside (start, stop)."""
        lo = np.searchsorted(self.doc_starts, start, side="right")
        hi = np.searchsorted(self.doc_starts, stop, side="left")
        return self.doc_starts[lo:hi] - start
