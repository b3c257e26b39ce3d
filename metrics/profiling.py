"""Profiling and debugging aids for the training loop.

* `Profiler`: torch.profiler windows (`profiling.profile_freq`, `profiler_warmup`,
  `profiler_active`) written as one Chrome trace per rank and window
  (`<dump>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json`, open in Perfetto or
  chrome://tracing), plus a summary per window: compute, communication and *exposed*
  communication time per step (see `comm_breakdown`).
* `MemorySnapshot`: on CUDA, the caching allocator's history recorded from the start and
  dumped after `profiling.memory_snapshot_step` and on an out-of-memory error
  (`<dump>/<save_memory_snapshot_folder>/rank<r>_step<s>.pickle`, open in
  https://pytorch.org/memory_viz). Not available on CPU: said once, nothing recorded.
* `PhaseTimer`: per-step wall time of the step's phases (forward+backward, optimizer) for
  the metrics, with CUDA events on GPUs (read at log steps, no extra synchronisation).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger("meshtrain")

# Names of profiler events that are collectives: NCCL kernels on GPUs, c10d/gloo ops on CPUs.
_COMM_MARKERS = ("nccl", "gloo", "c10d::", "record_param_comms", "all_gather", "allgather",
                 "reduce_scatter", "all_reduce", "allreduce", "broadcast", "all_to_all")  # fmt: skip


def is_comm_event(name: str) -> bool:
    name = name.lower()
    return any(m in name for m in _COMM_MARKERS)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union(a) not covered by union(b); both already merged and sorted."""
    total, j = 0.0, 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            total += end - cur
    return total


def comm_breakdown(events, device_type: str) -> dict[str, float]:
    """Seconds of compute, communication and exposed communication in profiler `events`.

    CUDA: on the GPU timeline, kernels whose name marks a collective (NCCL) are
    communication, all other kernels compute; exposed communication is the time some
    collective runs while no compute kernel does (overlapped communication is free).
    CPU (gloo): collectives run on gloo's own threads, so what the step waits for is the
    time the training thread spends inside collective calls and waits (c10d, FSDP and
    functional-collective events); compute is the rest of the profiled steps' time.
    Exposed = that blocking time (the background transfers themselves are not counted).
    """
    comm, compute = [], []
    if device_type == "cuda":
        for e in events:
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            span = (e.time_range.start / 1e6, e.time_range.end / 1e6)
            (comm if is_comm_event(e.name) else compute).append(span)
        comm_u, compute_u = _union(comm), _union(compute)
        return {
            "compute_s": _length(compute_u),
            "comm_s": _length(comm_u),
            "exposed_comm_s": _minus(comm_u, compute_u),
        }
    threads: dict[int, int] = {}
    for e in events:
        threads[e.thread] = threads.get(e.thread, 0) + 1
    main = max(threads, key=threads.get) if threads else None
    steps = []
    for e in events:
        if e.thread != main:
            continue
        span = (e.time_range.start / 1e6, e.time_range.end / 1e6)
        if e.name.startswith("ProfilerStep"):
            steps.append(span)
        elif is_comm_event(e.name) or "wait" in e.name.lower():
            comm.append(span)  # nested comm events merge into their parent's span
    comm_u = _union(comm)
    exposed = _length(comm_u)
    step_time = _length(_union(steps))
    return {
        "compute_s": max(0.0, step_time - exposed),
        "comm_s": exposed,
        "exposed_comm_s": exposed,
    }


@dataclass
class Profiler:
    """Wraps torch.profiler for the loop: `step()` after every training step."""

    cfg: object  # the [profiling] section
    dump_folder: str
    rank: int
    device_type: str
    start_step: int = 0  # steps already done (a resumed run)
    on_summary: object = None  # called with (step, {"compute_s", "comm_s", ...} per step)
    _prof: object = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.cfg.enable_profiling:
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        c = self.cfg
        folder = Path(self.dump_folder) / c.save_traces_folder
        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        elif self.rank == 0:
            logger.info(
                "profiling on %s: traces hold CPU operators only (no device kernels, so "
                "exposed communication is the training thread's time blocked in collectives)",
                self.device_type,
            )
        wait = c.profile_freq - c.profiler_warmup - c.profiler_active
        # The first window ends at the first multiple of profile_freq after start_step.
        skip = c.profile_freq - (self.start_step % c.profile_freq) if self.start_step else 0
        skip = skip % c.profile_freq

        def handler(prof) -> None:
            step = self.start_step + prof.step_num
            out = folder / f"iteration_{step}"
            out.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            prof.export_chrome_trace(str(out / f"rank{self.rank}_trace.json"))
            summary = comm_breakdown(prof.events(), self.device_type)
            summary = {k: v / c.profiler_active for k, v in summary.items()}
            logger.info(
                "profiler: trace of steps %d-%d in %s (%.1f s); per step compute %.3f s, "
                "communication %.3f s, exposed communication %.3f s",
                step - c.profiler_active + 1,
                step,
                out,
                time.perf_counter() - t0,
                summary["compute_s"],
                summary["comm_s"],
                summary["exposed_comm_s"],
            )
            if self.on_summary is not None:
                self.on_summary(step, summary)

        self._prof = profile(
            activities=activities,
            schedule=schedule(
                skip_first=skip,
                wait=wait,
                warmup=c.profiler_warmup,
                active=c.profiler_active,
            ),
            on_trace_ready=handler,
            record_shapes=False,
        )
        self._prof.__enter__()

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def close(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)


@dataclass
class MemorySnapshot:
    """CUDA allocator history, dumped after one step and on OOM (see the module doc)."""

    cfg: object
    dump_folder: str
    rank: int
    device_type: str
    enabled: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if not self.cfg.enable_memory_snapshot:
            return
        if self.device_type != "cuda" or not torch.cuda.is_available():
            if self.rank == 0:
                logger.info(
                    "profiling.enable_memory_snapshot: memory snapshots record the CUDA "
                    "caching allocator and are not available on %s; skipped",
                    self.device_type,
                )
            return
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.enabled = True

    def _dump(self, tag: str) -> Path:
        folder = Path(self.dump_folder) / self.cfg.save_memory_snapshot_folder
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_{tag}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        logger.info("memory snapshot written to %s (open in https://pytorch.org/memory_viz)", path)
        return path

    def step(self, step: int) -> None:
        if self.enabled and step == self.cfg.memory_snapshot_step:
            self._dump(f"step{step}")

    def on_oom(self, step: int) -> None:
        if self.enabled:
            self._dump(f"oom_step{step}")

    def close(self) -> None:
        if self.enabled:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.enabled = False


class PhaseTimer:
    """Wall time of a step's phases, averaged over the steps since the last `pop()`.

    `start()` at the beginning of the timed part, `mark(name)` at the end of each phase.
    On CUDA each mark records an event and the durations are read in `pop()`, after the
    trainer's log-step synchronisation; elsewhere `time.perf_counter()` is read directly.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[list[tuple[str, object]]] = []
        self.totals: dict[str, float] = {}
        self.steps = 0

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.pending.append([("", self._now())])
        self.steps += 1

    def mark(self, name: str) -> None:
        self.pending[-1].append((name, self._now()))

    def pop(self) -> dict[str, float]:
        """Mean seconds per step of each phase since the last pop (synchronise first)."""
        for marks in self.pending:
            for (_, a), (name, b) in zip(marks, marks[1:]):
                dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
                self.totals[name] = self.totals.get(name, 0.0) + dt
        out = {k: v / max(1, self.steps) for k, v in self.totals.items()}
        self.pending, self.totals, self.steps = [], {}, 0
        return out
