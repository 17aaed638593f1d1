"""Session fixtures' outputs made once per test run, however many processes the run has.

pytest-xdist's workers each build their own session fixtures; a tiny model compiled in both workers costs the
run its CPU twice. `built_once` keeps such an output in the run's shared build directory: the first process
that asks builds it under an exclusive lock, and every other process waits on the lock and reuses it. An output
whose build did not finish (the process died) has no completion file and is built again.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from octavo.cache_dir import exclusive_lock

# The run's build directory, made by the process pytest was started in (conftest's pytest_configure); pytest-xdist's
# workers, started after it, inherit the variable.
BUILDS_DIR_ENV = "OCTAVO_TEST_BUILDS_DIR"
DONE_SUFFIX = ".done"  # holds the output's path relative to its directory


def built_once(name: str, build: Callable[[Path], Path]) -> Path:
    """`build(directory)`'s output under the name `name` (which must say everything the build depends on): built by
    the first process of the run that asks, reused by the rest.

    `build` is given an empty directory and returns the path it made inside it (the directory itself or a
    file or subdirectory of it)."""
    root = Path(os.environ[BUILDS_DIR_ENV]) / "shared"
    root.mkdir(parents=True, exist_ok=True)
    directory = root / name
    done = root / f"{name}{DONE_SUFFIX}"
    with exclusive_lock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            output = build(directory)
            done.write_text(str(output.relative_to(directory)))
    return directory / done.read_text()
