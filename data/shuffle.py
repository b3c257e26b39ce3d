"""Seeded shuffling of an epoch's sequences: a permutation that costs O(1) per index.

`permuted(index, count, seed, epoch)` maps sequence position `index` of epoch `epoch` to the
sequence of the corpus read there. It is a bijection of [0, count), computed on its own for every
index (no table, no state): a 4-round Feistel network over the smallest even-bit domain holding
`count`, whose round function is splitmix64 of the (seed, epoch, round) key and the half being
mixed, with cycle walking (re-applying the network until the value falls inside [0, count), fewer
than 4 applications on average since the domain is under 4 x count). So the global stream stays
a pure function of the global sequence number: identical on every data-parallel layout, and a
resume at any position (and any DP degree) continues exactly.

What is shuffled is the order of the packed sequences (each still holds consecutive tokens of
the corpus, documents packed in source order), not the documents before packing: that keeps
O(1) indexing without a per-document table, and a document longer than a sequence is still
seen as consecutive pieces, only at scattered steps.
"""

from __future__ import annotations

from functools import lru_cache

_MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """The splitmix64 finaliser of `value + golden ratio` (a well-mixed 64-bit hash)."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@lru_cache(maxsize=8)
def round_keys(seed: int, epoch: int) -> tuple[int, ...]:
    """The 4 Feistel round keys of one epoch: every epoch has its own order."""
    epoch_key = splitmix64(splitmix64(seed & _MASK64) ^ epoch)
    return tuple(splitmix64(epoch_key ^ (r << 60)) for r in range(4))


def permuted(index: int, count: int, seed: int, epoch: int) -> int:
    """Position `index` (0 <= index < count) of the epoch's permutation of [0, count)."""
    if not 0 <= index < count:
        raise IndexError(f"index {index} outside [0, {count})")
    half = max(1, ((count - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = round_keys(seed, epoch)
    value = index
    while True:
        left, right = value >> half, value & mask
        for key in keys:
            left, right = right, left ^ (splitmix64(key ^ right) & mask)
        value = (left << half) | right
        if value < count:
            return value
