"""Metrics sink: JSON lines, TensorBoard scalars and a compact console line."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from numbers import Integral, Real
from types import TracebackType
from typing import Any

logger = logging.getLogger("meshtrain")

JSONL_FILE_NAME = "metrics.jsonl"
_RESERVED_KEYS = ("step", "kind", "time")


def _to_number(key: str, value: Any) -> int | float:
    """Plain Python number for JSON/TensorBoard (accepts numpy and 0-d torch scalars)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, Integral):
        return int(value)
    if isinstance(value, Real) or hasattr(value, "item"):
        return float(value)
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")


def _train_fields(values: dict[str, float]) -> list[str]:
    formats = [
        ("loss", "loss {:.4f}"),
        ("grad_norm", "grad_norm {:.2f}"),
        ("lr", "lr {:.1e}"),
        ("tokens_per_sec", "tok/s/dev {:,.0f}"),
        ("tflops", "tflops {:.2f}"),
        ("mfu", "mfu {:.1f}%"),
        ("memory_gib", "mem {:.2f}GiB"),
        ("step_time_s", "step {:.2f}s"),
        ("data_time_s", "data {:.3f}s"),
    ]
    return [fmt.format(values[key]) for key, fmt in formats if key in values]


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def format_record(step: int, values: dict[str, float], kind: str = "train") -> str:
    """One colour-free console line for a record.

    Train: ``step 10 | loss 7.1234 | grad_norm 1.23 | lr 8.0e-04 | tok/s/dev 1,234 | ...``.
    Validation: ``validation step 10 | loss 6.5432 | ppl 692.35`` (perplexity = exp(loss)
    unless a ``perplexity`` value is given). Other kinds list all values.
    """
    if kind == "train":
        fields = _train_fields(values)
    elif kind == "validation" and "loss" in values:
        ppl = values.get("perplexity", _perplexity(values["loss"]))
        fields = [f"loss {values['loss']:.4f}", f"ppl {ppl:.2f}"]
    else:
        fields = [f"{key} {value:.4g}" for key, value in values.items()]
    prefix = f"step {step}" if kind == "train" else f"{kind} step {step}"
    return " | ".join([prefix, *fields])


class MetricsLogger:
    """Writes metrics on the logging rank; a disabled instance does nothing.

    Each ``log`` appends one JSON object (``step``, ``kind``, ``time`` plus the values)
    to ``<dump_folder>/metrics.jsonl`` and flushes it, writes TensorBoard scalars tagged
    ``<kind>/<key>`` under ``<dump_folder>/<tb_folder>``, and logs a compact line to the
    ``meshtrain`` python logger. ``enabled`` defaults to ``rank == 0``; pass it
    explicitly when another rank holds the loss (e.g. the last pipeline stage).
    """

    def __init__(
        self,
        dump_folder: str,
        rank: int,
        enable_tensorboard: bool = True,
        tb_folder: str = "tb",
        console: bool = True,
        enabled: bool | None = None,
    ) -> None:
        self.rank = rank
        self.enabled = rank == 0 if enabled is None else enabled
        self.console = console
        self.jsonl_path = os.path.join(dump_folder, JSONL_FILE_NAME)
        self.tb_dir = os.path.join(dump_folder, tb_folder)
        self._jsonl = None
        self._writer = None
        self._closed = False
        if not self.enabled:
            return
        os.makedirs(dump_folder, exist_ok=True)
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.tb_dir)

    def log(self, step: int, values: dict[str, float], kind: str = "train") -> None:
        """Record ``values`` for ``step`` under ``kind`` ("train", "validation", ...)."""
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log() called after close()")
        clashes = [key for key in _RESERVED_KEYS if key in values]
        if clashes:
            raise ValueError(f"metric names {clashes} are reserved")
        numbers = {key: _to_number(key, value) for key, value in values.items()}

        record = {"step": step, "kind": kind, "time": time.time(), **numbers}
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()

        if self._writer is not None:
            for key, value in numbers.items():
                self._writer.add_scalar(f"{kind}/{key}", value, step)
            self._writer.flush()

        if self.console:
            logger.info(format_record(step, numbers, kind))

    def close(self) -> None:
        """Flush and close the files; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()
        if self._jsonl is not None:
            self._jsonl.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
