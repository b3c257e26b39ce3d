"""Checkpoint folders on disk: naming, discovery, the commit protocol and the layout file.

    <job.dump_folder>/<checkpoint.folder>/
        step-10/                  complete: visible to resume and to `initial_load_path`
            __0_0.distcp ...      each rank's own shards (DCP, one file per rank)
            .metadata             DCP global metadata, written by rank 0 after all ranks wrote
            layout.json           step, contents, parallel degrees, world size, model args
        step-20.tmp/              being written, or left by a killed save: never loaded
        export-step-20/           weights-only export at the last step (checkpoint.model_only)

Commit protocol: every rank writes into `step-N.tmp/`; DCP's final gather makes rank 0 write
`.metadata` only after every rank reported its writes; rank 0 then writes `layout.json` and
renames the folder to `step-N` (an atomic rename on POSIX file systems). A folder counts as a
checkpoint only when it is named `step-N` and holds both `.metadata` and `layout.json`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

logger = logging.getLogger("meshtrain")

STEP_RE = re.compile(r"^step-(\d+)$")
TMP_SUFFIX = ".tmp"
LAYOUT_FILE = "layout.json"
METADATA_FILE = ".metadata"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found, read or loaded into this run; one message says why."""


def step_dir(folder: Path, step: int, prefix: str = "step") -> Path:
    return Path(folder) / f"{prefix}-{step}"


def tmp_path(final: Path) -> Path:
    return final.with_name(final.name + TMP_SUFFIX)


def is_complete(path: Path) -> bool:
    """A committed checkpoint folder: DCP metadata and our layout file are both present."""
    path = Path(path)
    return (path / METADATA_FILE).is_file() and (path / LAYOUT_FILE).is_file()


def list_checkpoints(folder: Path, *, warn: bool = True) -> list[tuple[int, Path]]:
    """Complete `step-N` checkpoints in `folder`, oldest first; incomplete ones are skipped
    (with a warning when `warn`)."""
    folder = Path(folder)
    found = []
    if not folder.is_dir():
        return found
    for entry in sorted(folder.iterdir()):
        if not entry.is_dir():
            continue
        m = STEP_RE.match(entry.name)
        if m and is_complete(entry):
            found.append((int(m.group(1)), entry))
        elif warn and (m or entry.name.endswith(TMP_SUFFIX)):
            logger.warning(
                "ignoring incomplete checkpoint %s (an interrupted or failed save): it is "
                "never loaded and is removed after the next successful save",
                entry,
            )
    return sorted(found)


def resolve_load_path(path: Path) -> Path:
    """A checkpoint folder itself, or the latest complete `step-N` inside a folder of them."""
    path = Path(path)
    if is_complete(path):
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1][1]
    if path.name.endswith(TMP_SUFFIX) or STEP_RE.match(path.name):
        raise CheckpointError(
            f"{path} is an incomplete checkpoint (no {METADATA_FILE} or "
            f"{LAYOUT_FILE}): an interrupted save; it cannot be loaded."
        )
    raise CheckpointError(
        f"No checkpoint at {path}: expected a checkpoint folder (with {METADATA_FILE} and "
        f"{LAYOUT_FILE}) or a folder holding step-N checkpoints."
    )


def read_layout(path: Path) -> dict:
    try:
        return json.loads((Path(path) / LAYOUT_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"Cannot read {Path(path) / LAYOUT_FILE}: {e}") from None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prepare_tmp(final: Path) -> Path:
    """Rank 0, before a save: an empty `<final>.tmp` (a stale one from a killed save is
    removed; it was never visible)."""
    tmp = tmp_path(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, final: Path, layout: dict) -> None:
    """Rank 0, after every rank's shards and DCP's `.metadata` are written: adds
    `layout.json` and atomically renames `tmp` to `final`. An existing `final` is never
    deleted: it is kept as `<final>.replaced-<time>` with a warning."""
    if not (tmp / METADATA_FILE).is_file():
        raise CheckpointError(f"{tmp} has no {METADATA_FILE}: the save did not finish")
    part = tmp / (LAYOUT_FILE + ".part")
    with open(part, "w") as f:
        json.dump({"format_version": FORMAT_VERSION, **layout}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, tmp / LAYOUT_FILE)
    _fsync_dir(tmp)
    if final.exists():
        kept = final.with_name(f"{final.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        logger.warning("%s already exists (saved by an earlier run): keeping it as %s", final, kept)
        os.rename(final, kept)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def remove_checkpoint(path: Path) -> None:
    """Hides a checkpoint with one atomic rename, then deletes it: a kill midway never
    leaves a half-deleted folder that still looks complete."""
    doomed = path.with_name(path.name + ".deleting" + TMP_SUFFIX)
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def purge(folder: Path, keep_latest_k: int, protect: Path | None = None) -> list[Path]:
    """Rank 0, after a commit: deletes leftovers of interrupted saves and, when
    `keep_latest_k` > 0, all but the newest k complete checkpoints, never `protect` (the one
    just committed, which may be older than others after a resume from load_step). Returns
    what it removed."""
    folder = Path(folder)
    removed = []
    for entry in sorted(folder.iterdir()):
        if entry.is_dir() and entry.name.endswith(TMP_SUFFIX):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    if keep_latest_k > 0:
        for _, path in list_checkpoints(folder, warn=False)[:-keep_latest_k]:
            if protect is not None and path.name == Path(protect).name:
                continue
            remove_checkpoint(path)
            removed.append(path)
    for path in removed:
        logger.info("checkpoint: removed %s", path)
    return removed
