"""Weighted mixtures of datasets, blended deterministically into one global sequence stream.

Global sequence `g` of the mixture is the next sequence of source `s(g)`, where `s(g)` is the
source furthest behind its share: the largest `w_s * (g + 1) - n_s(g)` (`n_s(g)`: sequences
taken from source s before g; weights normalised to sum 1; ties to the first source). This greedy
rule (the one Megatron-LM's blended datasets use) keeps every source within one sequence of its
share at every g, so in any window of steps each source's share follows the weights to within
two sequences, whatever the window. Each source is its own stream (shuffled with its own seed,
wrapping its own epochs), read from its position `n_s`.

The choice depends only on g and the counts, which every data-parallel rank keeps (each rank
walks every row of the global batch), so the stream is the same on every layout; the loader
state's cursor holds the counts and each source's cursor, so a resume, at any DP degree,
continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from data.dataset import SequenceSource, Window


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


@dataclass
class MixtureSource:
    """Several sources blended by weight (see the module docstring)."""

    sources: list[SequenceSource]
    weights: list[float]
    labels: list[str]  # one per source, for the metrics (`tokens_<label>`)

    def __post_init__(self) -> None:
        total = sum(self.weights)
        self.shares = [w / total for w in self.weights]
        self.seq_len = self.sources[0].seq_len
        self.name = "mixture(" + ", ".join(s.name for s in self.sources) + ")"
        self.fingerprint = "mixture:" + ",".join(
            f"{s.fingerprint}@{w:g}" for s, w in zip(self.sources, self.shares)
        )

    def reader(self, position: int, cursor: dict[str, Any], infinite: bool) -> MixtureReader:
        if position and "counts" not in cursor:
            raise ValueError("resuming a mixture needs the 'cursor' saved with the loader state")
        counts = list(cursor.get("counts", [0] * len(self.sources)))
        cursors = list(cursor.get("sources", [{}] * len(self.sources)))
        readers = [
            s.reader(n, c, infinite) for s, n, c in zip(self.sources, counts, cursors, strict=True)
        ]
        return MixtureReader(self, position, counts, readers)


class MixtureReader:
    """Walks the blended stream; `counts[s]` = sequences taken from source s so far."""

    def __init__(self, mixture: MixtureSource, position: int, counts: list[int], readers) -> None:
        self.mixture, self.position, self.counts, self.readers = mixture, position, counts, readers
        self._shares = np.asarray(mixture.shares)

    def advance(self, keep: bool) -> Window | None:
        deficit = self._shares * (self.position + 1) - np.asarray(self.counts)
        source = int(np.argmax(deficit))
        window = self.readers[source].advance(keep)  # EndOfEpoch (finite) ends the mixture
        self.counts[source] += 1
        self.position += 1
        return window

    def cursor(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sources": [r.cursor() for r in self.readers]}

    def source_sequences(self) -> dict[str, int]:
        """Sequences taken from each source so far (over all ranks: every rank walks them)."""
        return dict(zip(self.mixture.labels, self.counts))
