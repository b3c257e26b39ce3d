"""Weighted mixtures of datasets, blended deterministically into one global sequence stream.

The weights become integers `a_s` (as given when they are integers summing to at most 2^20,
else the shares rounded to 1/65536) with period `D = sum a_s`. Global sequence `g` is the next
sequence of source `s(g)`, the source furthest below its share: the largest
`a_s (g + 1) / D - n_s(g)` (`n_s(g)`: sequences taken from s before g; ties to the first
source), Megatron-LM's greedy blending rule. It keeps every source within one sequence of its
share at every g, so in any window of steps each source's share follows the weights to within
two sequences. After D sequences every source has had exactly its `a_s`, so the rule repeats
with period D: one period's choices and running counts are tabulated once, and `s(g)` and
`n_s(g)` are O(1) for any g. Each source is its own stream (shuffled with its own seed,
wrapping its own epochs), read at position `n_s(g)`.

So the stream is a pure function of g: identical on every data-parallel layout, and with
random-access sources (token files) each rank reads only its own rows (`window(g)`); a mixture
with a streamed source is walked row by row, its cursor holding each source's cursor. A resume,
at any DP degree, continues exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from data.dataset import SequenceSource, Window
from data.readers import WalkingReader, random_access_rows


def parse_mixture(entries: list[str]) -> list[tuple[str, str, float]]:
    """`KIND:PATH:WEIGHT` entries -> (kind, path, weight); the path may hold colons."""
    parsed = []
    for entry in entries:
        kind, _, rest = entry.partition(":")
        path, _, weight = rest.rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not kind or not path or not value > 0:
            raise ValueError(
                f"mixture entry {entry!r} is not KIND:PATH:WEIGHT with a weight > 0 (e.g. "
                "'megatron:/data/web:0.7')"
            )
        parsed.append((kind, path, value))
    return parsed


_MAX_PERIOD = 2**20
_QUANTUM = 2**16


def integer_weights(weights: list[float]) -> list[int]:
    """The weights as integers of the same proportions (see the module docstring)."""
    if all(float(w).is_integer() for w in weights) and sum(weights) <= _MAX_PERIOD:
        ints = [int(w) for w in weights]
        divisor = math.gcd(*ints)
        return [w // divisor for w in ints]
    total = sum(weights)
    ints = [max(1, round(w / total * _QUANTUM)) for w in weights]
    ints[int(np.argmax(ints))] += _QUANTUM - sum(ints)
    return ints


def blend_period(ints: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source of each g in one period, counts before each g: [period + 1, sources])."""
    period = sum(ints)
    shares = np.asarray(ints, dtype=np.float64) / period
    choice = np.zeros(period, dtype=np.int32)
    counts = np.zeros((period + 1, len(ints)), dtype=np.int64)
    taken = np.zeros(len(ints), dtype=np.int64)
    for g in range(period):
        source = int(np.argmax(shares * (g + 1) - taken))
        choice[g] = source
        taken[source] += 1
        counts[g + 1] = taken
    assert np.array_equal(taken, ints)  # the period closes: the rule repeats
    return choice, counts


@dataclass
class MixtureSource:
    """Several sources blended by weight (see the module docstring)."""

    sources: list[SequenceSource]
    weights: list[float]
    labels: list[str]  # one per source, for the metrics (`tokens_<label>`)

    def __post_init__(self) -> None:
        self.ints = integer_weights(self.weights)
        self.period = sum(self.ints)
        self.choice, self.counts = blend_period(self.ints)
        self.seq_len = self.sources[0].seq_len
        self.random_access = all(getattr(s, "random_access", False) for s in self.sources)
        self.name = "mixture(" + ", ".join(s.name for s in self.sources) + ")"
        self.fingerprint = "mixture:" + ",".join(
            f"{s.fingerprint}@{w}" for s, w in zip(self.sources, self.ints)
        )

    def taken(self, position: int) -> np.ndarray:
        """Sequences taken from each source before global sequence `position`."""
        cycles, offset = divmod(position, self.period)
        return cycles * np.asarray(self.ints, dtype=np.int64) + self.counts[offset]

    def locate(self, position: int) -> tuple[int, int]:
        """(source, its own sequence number) of global sequence `position`."""
        source = int(self.choice[position % self.period])
        return source, int(self.taken(position)[source])

    def window(self, position: int, infinite: bool) -> Window:
        """Global sequence `position` (random-access sources only)."""
        source, index = self.locate(position)
        return self.sources[source].window(index, infinite)

    def reader(self, position: int, cursor: dict[str, Any], infinite: bool):
        if self.random_access:
            return MixtureReader(self, position, [], infinite)
        if position and "sources" not in cursor:
            raise ValueError("resuming a mixture needs the 'cursor' saved with the loader state")
        counts = self.taken(position).tolist()
        cursors = list(cursor.get("sources", [{}] * len(self.sources)))
        readers = [
            s.reader(n, c, infinite) for s, n, c in zip(self.sources, counts, cursors, strict=True)
        ]
        return MixtureReader(self, position, readers, infinite)


class MixtureReader(WalkingReader):
    """Walks the blended stream: by position alone for random-access sources, else through
    each source's own reader."""

    def __init__(self, mixture: MixtureSource, position: int, readers, infinite: bool) -> None:
        self.mixture, self.position, self.readers = mixture, position, readers
        self.infinite = infinite

    def advance(self, keep: bool) -> Window | None:
        if self.readers:
            window = self.readers[self.mixture.locate(self.position)[0]].advance(keep)
        else:
            window = self.mixture.window(self.position, self.infinite) if keep else None
        self.position += 1
        return window

    def read_rows(self, rows: range, end: int) -> list[Window]:
        if self.readers:
            return super().read_rows(rows, end)
        return random_access_rows(self, self.mixture, rows, end)

    def cursor(self) -> dict[str, Any]:
        return {"sources": [r.cursor() for r in self.readers]} if self.readers else {}

    def source_sequences(self) -> dict[str, int]:
        """Sequences taken from each source so far, over all ranks."""
        return dict(zip(self.mixture.labels, self.mixture.taken(self.position).tolist()))
