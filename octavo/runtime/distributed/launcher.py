"""Starting the worker ranks of this node (torch.multiprocessing, spawn) and watching them exit."""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
import time
from collections.abc import Callable

import torch.multiprocessing as mp

from octavo.runtime.distributed.worker import WorkerSpec, worker_main

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 10.0


class LocalWorkers:
    """The worker processes of this node; a watcher thread records each exit code as it happens.

    `on_exit(rank, exitcode)` is called from the watcher thread for every
    worker that exits, in the order they exit.
    """

    def __init__(self, specs: list[WorkerSpec], on_exit: Callable[[int, int], None] | None = None):
        context = mp.get_context("spawn")
        self.processes = {spec.rank: context.Process(target=worker_main, args=(spec,), daemon=True,
                                                     name=f"octavo-rank-{spec.rank}") for spec in specs}
        self.exits: dict[int, int] = {}
        self._on_exit = on_exit
        for process in self.processes.values():
            process.start()
        self._watcher = threading.Thread(target=self._watch, name="octavo-worker-watcher", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        alive = {process.sentinel: rank for rank, process in self.processes.items()}
        while alive:
            for sentinel in multiprocessing.connection.wait(list(alive)):
                rank = alive.pop(sentinel)
                process = self.processes[rank]
                exitcode = _exitcode(process)
                self.exits[rank] = exitcode
                if exitcode != 0:
                    logger.error("rank %d (pid %d) exited with code %s", rank, process.pid, exitcode)
                if self._on_exit is not None:
                    self._on_exit(rank, exitcode)

    def join(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Wait for the workers to exit on their own, then end the ones that did not."""
        for process in self.processes.values():
            process.join(timeout)
        for process in self.processes.values():
            if process.is_alive():
                logger.warning("rank process %s did not exit; terminating it", process.name)
                process.terminate()
                process.join(_JOIN_TIMEOUT_S)
                if process.is_alive():
                    process.kill()
                    process.join()

    def wait_all(self) -> dict[int, int]:
        """Block until every worker has exited; their exit codes by rank."""
        self._watcher.join()
        return dict(self.exits)


def _exitcode(process) -> int:
    """The exit code of a process whose sentinel fired; `join` from another thread may reap it first, and
    then this thread's join sees no code for a moment."""
    deadline = time.monotonic() + 5.0
    process.join(1.0)
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return process.exitcode if process.exitcode is not None else -1
