"""Octavo's launcher watches its worker processes: how each ended, reported once its exit callback has run.

The worker here is a standard-library module that fails on its argument at once (`python -m json.tool <missing
file>` exits with code 2), so the test is about the watch itself, not about a rank's work.
"""

from __future__ import annotations

import time

from octavo.runtime.distributed.launcher import LocalWorkers
from octavo.runtime.distributed.rendezvous import Rendezvous

FAILING_MODULE = "json.tool"
MISSING_FILE = "/nonexistent/octavo-launcher-test"


def rendezvous_of(ranks: list[int]) -> dict[int, Rendezvous]:
    first = Rendezvous(0, 1 + len(ranks), 0, 1 + len(ranks), "127.0.0.1", 29500, "octavo")
    return {rank: first.for_rank(rank, rank) for rank in ranks}


def test_an_exit_counts_once_its_callback_has_returned():
    # A process that leaves when wait_all returns must not find a watcher thread still inside the callback (which
    # records the exit in the rendezvous store: a daemon thread unwound there at interpreter exit aborts the process).
    finished = []

    def slow_callback(rank: int, failure: str | None) -> None:
        time.sleep(0.5)
        finished.append((rank, failure))

    workers = LocalWorkers(FAILING_MODULE, MISSING_FILE, rendezvous_of([1, 2]), on_exit=slow_callback)
    ends = workers.wait_all()
    assert ends == {1: "exited with code 2", 2: "exited with code 2"}
    assert sorted(finished) == [(1, "exited with code 2"), (2, "exited with code 2")]
    assert workers.failures == ends


def test_a_failing_callback_still_counts_the_exit(caplog):
    def failing_callback(rank: int, failure: str | None) -> None:
        raise RuntimeError("the store is gone")

    workers = LocalWorkers(FAILING_MODULE, MISSING_FILE, rendezvous_of([1]), on_exit=failing_callback)
    assert workers.wait_all() == {1: "exited with code 2"}
    assert "the exit callback of rank 1 failed" in caplog.text
    assert "RuntimeError: the store is gone" in caplog.text
