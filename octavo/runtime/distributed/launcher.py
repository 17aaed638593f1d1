"""Starting the worker ranks of this node (torch.multiprocessing, spawn) and watching them exit."""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
from collections.abc import Callable

import torch.multiprocessing as mp

from octavo.runtime.distributed.worker import WorkerSpec, worker_main

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 10.0


class LocalWorkers:
    """The worker processes of this node; a watcher thread records each exit code as it happens.

    Only the watcher reaps the processes (two threads waiting on one child
    race for its exit code). `on_exit(rank, exitcode)` is called from the
    watcher thread for every worker that exits, in the order they exit.
    """

    def __init__(self, specs: list[WorkerSpec], on_exit: Callable[[int, int], None] | None = None):
        context = mp.get_context("spawn")
        self.processes = {spec.rank: context.Process(target=worker_main, args=(spec,), daemon=True,
                                                     name=f"octavo-rank-{spec.rank}") for spec in specs}
        self.exits: dict[int, int] = {}
        self._all_exited = threading.Event()
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
                process.join()
                exitcode = process.exitcode if process.exitcode is not None else -1
                self.exits[rank] = exitcode
                if exitcode != 0:
                    logger.error("rank %d (pid %d) exited with code %s", rank, process.pid, exitcode)
                if self._on_exit is not None:
                    self._on_exit(rank, exitcode)
        self._all_exited.set()

    def join(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Wait for the workers to exit on their own, then terminate (and at last kill) the ones that did not."""
        for action in ("terminate", "kill"):
            if self._all_exited.wait(timeout):
                return
            for rank, process in self.processes.items():
                if rank not in self.exits:
                    logger.warning("rank process %s did not exit; %s", process.name,
                                   "terminating it" if action == "terminate" else "killing it")
                    getattr(process, action)()
            timeout = _JOIN_TIMEOUT_S
        self._all_exited.wait(timeout)

    def wait_all(self) -> dict[int, int]:
        """Block until every worker has exited; their exit codes by rank."""
        self._all_exited.wait()
        return dict(self.exits)
