"""How a reader reaches the rows of a global batch (`SequenceReader.read_rows`): by random
access (`window(g)` of the source, a rank reading only its own rows) or by walking past every
row before them (a stream)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from data.dataset import Window


class WalkingReader:
    """`read_rows` for a reader that reaches a row only by walking past those before it."""

    position: int

    def read_rows(self, rows: range, end: int) -> list[Window]:
        windows = []
        while self.position < end:
            window = self.advance(keep=self.position in rows)
            if window is not None:
                windows.append(window)
        return windows


def random_access_rows(reader: Any, source: Any, rows: range, end: int) -> list[Window]:
    """`rows` by `source.window(g)` alone (a random-access source: a rank reads only its
    own rows), then `reader.position` is `end`; a finite pass (`reader.infinite` false)
    first checks that its global batch ends inside epoch 0 (the last incomplete one is
    dropped)."""
    if not reader.infinite:
        source.window(end - 1, False)
    windows = [source.window(g, reader.infinite) for g in rows]
    reader.position = end
    return windows
