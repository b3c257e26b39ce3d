"""On-disk cache helpers: the default cache folder and build-once-under-a-lock file creation."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger("meshtrain")

_REPO_ROOT = Path(__file__).resolve().parent.parent


def default_cache_dir() -> str:
    """Return $MESHTRAIN_CACHE if set, else the git-ignored `<repo>/.cache` folder."""
    return os.environ.get("MESHTRAIN_CACHE", str(_REPO_ROOT / ".cache"))


def build_once(targets: Sequence[Path], build: Callable[[list[Path]], None]) -> None:
    """Create `targets` by calling `build(temp_paths)` once, even with many concurrent processes.

    The first process to take an exclusive `flock` on `<targets[0]>.lock` builds into unique
    temporary names and renames them into place (last target last, so it marks completion);
    the others block on the lock and then find the files ready. Builds are deterministic, so on
    a file system where `flock` is not honoured the worst case is duplicated work, never a
    partially written file.
    """
    targets = [Path(t) for t in targets]
    if all(t.exists() for t in targets):
        return
    targets[0].parent.mkdir(parents=True, exist_ok=True)
    lock_path = targets[0].with_name(targets[0].name + ".lock")
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            if all(t.exists() for t in targets):
                return
            suffix = f".{socket.gethostname()}.{os.getpid()}.tmp"
            temps = [t.with_name(f".{t.name}{suffix}") for t in targets]
            try:
                build(temps)
                for temp, target in zip(temps, targets):
                    os.replace(temp, target)
            finally:
                for temp in temps:
                    temp.unlink(missing_ok=True)
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
