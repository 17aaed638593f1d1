"""Where Octavo keeps what it builds for this machine: compiled artifacts, native kernels."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

CACHE_DIR_ENV = "OCTAVO_CACHE_DIR"


def cache_root() -> Path:
    """OCTAVO_CACHE_DIR, else $XDG_CACHE_HOME/octavo, else ~/.cache/octavo."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "octavo"


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_path` across processes (a no-op where fcntl does not exist: the cache's
    writers stage and rename, so that a reader never sees half an entry)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
