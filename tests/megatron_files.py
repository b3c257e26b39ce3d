"""Megatron-LM indexed datasets (.bin/.idx) written by the tests' own writer, which follows the
published layout (Megatron-LM `megatron/core/datasets/indexed_dataset.py`, `_IndexWriter`)
independently of `data.indexed`; for tests/unit/test_data_indexed.py and
tests/integration/test_train_e2e.py."""

from __future__ import annotations

import struct

import numpy as np

CODES = {np.uint16: 8, np.int32: 4, np.uint8: 1, np.int64: 5}


def write_megatron(prefix, documents, dtype=np.uint16, sentences=False, modes=False) -> None:
    """Megatron's layout: .bin = the sequences back to back; .idx = magic, version 1, dtype
    code, sequence count, document-index count, int32 lengths, int64 byte pointers, int64
    document indices [0, ..., S] (and int8 modes if multimodal). With `sentences` every
    document is split into sequences of at most 3 tokens (preprocess_data --split-sentences)."""
    sequences, doc_index = [], [0]
    for doc in documents:
        pieces = [doc[i : i + 3] for i in range(0, len(doc), 3)] if sentences else [doc]
        sequences += pieces
        doc_index.append(len(sequences))
    item = np.dtype(dtype).itemsize
    lengths = [len(s) for s in sequences]
    pointers = [item * sum(lengths[:i]) for i in range(len(lengths))]
    with open(f"{prefix}.bin", "wb") as out:
        for s in sequences:
            out.write(np.asarray(s, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as out:
        out.write(b"MMIDIDX\x00\x00")
        out.write(struct.pack("<Q", 1))
        out.write(struct.pack("<B", CODES[dtype]))
        out.write(struct.pack("<Q", len(sequences)))
        out.write(struct.pack("<Q", len(doc_index)))
        out.write(struct.pack(f"<{len(lengths)}i", *lengths))
        out.write(struct.pack(f"<{len(pointers)}q", *pointers))
        out.write(struct.pack(f"<{len(doc_index)}q", *doc_index))
        if modes:
            out.write(bytes(len(sequences)))


def documents(count: int, seed: int, vocab: int = 200) -> list[list[int]]:
    """Documents of 1-20 random ids below `vocab`, no end-of-document token anywhere (ids of
    the byte tokenizer's BOS/EOS are 256/257)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(1, 21)).tolist() for _ in range(count)]
