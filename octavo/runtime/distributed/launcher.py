"""Octavo's own launcher: the worker ranks of this node as processes of their own, and a watch on their exits.

Each worker runs ``python -m <worker module> <spec>`` with the variables
torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...): it
imports Octavo, never the user's program, so a script without a main guard,
a notebook and code fed on stdin all start ranks alike. Workers read no
stdin (an interactive `octavo chat` keeps it), write to the same console,
and die with the process that started them (on Linux, through the parent
death signal).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from octavo.runtime.distributed.failures import describe_exit
from octavo.runtime.distributed.rendezvous import Rendezvous

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 10.0
PARENT_PID_ENV = "OCTAVO_PARENT_PID"
"""Set for a worker: the pid of the process that started it (the worker exits when that one is gone)."""


def worker_command(module: str, spec: str) -> list[str]:
    """The command line of a worker: this Python running `module` with `spec` (JSON) as its one argument."""
    return [sys.executable, "-m", module, spec]


def worker_environment(rendezvous: Rendezvous) -> dict[str, str]:
    """This process's environment, the rank's rendezvous variables, and the path this Octavo was imported from."""
    package_root = str(Path(__file__).resolve().parents[3])  # the directory that holds the octavo package
    python_path = os.pathsep.join(part for part in (package_root, os.environ.get("PYTHONPATH")) if part)
    return {**os.environ, **rendezvous.environment(), "PYTHONPATH": python_path, PARENT_PID_ENV: str(os.getpid())}


def call_exit_callback(on_exit: Callable[[int, str | None], None], rank: int, failure: str | None) -> None:
    """Tell `on_exit` how a rank ended, from a launcher's watcher thread: an exception it raises is logged, so the
    watcher goes on to count the exit."""
    try:
        on_exit(rank, failure)
    except Exception:
        logger.exception("the exit callback of rank %d failed", rank)


class LocalWorkers:
    """The worker processes of this node; one watcher thread per worker records its exit as it happens.

    `on_exit(rank, failure)` is called from a watcher thread for every worker
    that exits: `failure` is None after a clean exit, else how it ended
    ("was killed by signal SIGKILL", "exited with code 1"). The exit counts
    (in `exits`, `wait_all`, `join`) once the call has returned; an exception
    it raises is logged.
    """

    def __init__(self, module: str, spec: str, rendezvous_of: dict[int, Rendezvous],
                 on_exit: Callable[[int, str | None], None] | None = None):
        self.processes: dict[int, subprocess.Popen] = {}
        self.exits: dict[int, str | None] = {}
        self._lock = threading.Lock()
        self._all_exited = threading.Event()
        self._on_exit = on_exit
        if not rendezvous_of:
            self._all_exited.set()
        for rank, rendezvous in rendezvous_of.items():
            self.processes[rank] = subprocess.Popen(worker_command(module, spec), env=worker_environment(rendezvous),
                                                    stdin=subprocess.DEVNULL)
        for rank, process in self.processes.items():
            threading.Thread(target=self._watch, args=(rank, process), name=f"octavo-rank-{rank}-watcher",
                             daemon=True).start()

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        exitcode = process.wait()
        failure = None if exitcode == 0 else describe_exit(exitcode)
        if failure is not None:
            logger.error("rank %d (pid %d) %s", rank, process.pid, failure)
        if self._on_exit is not None:
            call_exit_callback(self._on_exit, rank, failure)
        # Only after the callback: a process that returns from wait_all and exits while this daemon thread is
        # still inside a store call aborts (the thread is unwound through c10d's C++ frames).
        with self._lock:
            self.exits[rank] = failure
            if len(self.exits) == len(self.processes):
                self._all_exited.set()

    @property
    def failures(self) -> dict[int, str]:
        """How the workers that failed ended, by rank."""
        return {rank: failure for rank, failure in dict(self.exits).items() if failure is not None}

    def terminate(self) -> None:
        """Ask every worker still running to stop now (SIGTERM)."""
        for rank, process in self.processes.items():
            if rank not in self.exits and process.poll() is None:
                process.terminate()

    def join(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Wait for the workers to exit on their own, then terminate (and at last kill) the ones that did not."""
        for action in ("terminate", "kill"):
            if self._all_exited.wait(timeout):
                return
            for rank, process in self.processes.items():
                if rank not in self.exits and process.poll() is None:
                    logger.warning("rank %d (pid %d) did not exit; %s", rank, process.pid,
                                   "terminating it" if action == "terminate" else "killing it")
                    getattr(process, action)()
            timeout = _JOIN_TIMEOUT_S
        self._all_exited.wait(timeout)

    def wait_all(self) -> dict[int, str | None]:
        """Block until every worker has exited; how each ended, by rank (None: cleanly)."""
        self._all_exited.wait()
        return dict(self.exits)
