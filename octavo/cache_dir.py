"""Where Octavo keeps what it builds for this machine: compiled artifacts, native kernels."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "OCTAVO_CACHE_DIR"


def cache_root() -> Path:
    """OCTAVO_CACHE_DIR, else $XDG_CACHE_HOME/octavo, else ~/.cache/octavo."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "octavo"
