"""Finding out which rank failed: exit records, error records and heartbeats in the rendezvous store.

A communication error on rank 0 says only that some connection closed or
some wait timed out. The cause is found here: Octavo's own launcher records
the exits of the ranks it started (`exit/<rank>`; under torchrun and srun
the launcher itself reports exits, and under Ray the actor's death), a rank
that raises records its error (`error/<rank>`), and every rank bumps a
heartbeat counter (`heartbeat/<rank>`) several times a second, so a rank
that froze, which no launcher notices, is the one whose counter stands
still.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import torch.distributed as dist

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.2
_EXIT, _ERROR, _HEARTBEAT, _READY = "exit/", "error/", "heartbeat/", "ready/"
# Error texts of a rank that merely lost a peer (its own failure is a consequence, not the cause).
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
              "exited during a shared-memory collective",
              "Socket closed", "Connection refused")


def record_exit(store: dist.Store, rank: int, failure: str | None) -> None:
    """Record how a rank this process started ended (None: cleanly), for rank 0 to read."""
    _quietly(lambda: store.set(f"{_EXIT}{rank}", failure or ""))


def record_error(store: dist.Store, rank: int, error: BaseException) -> None:
    _quietly(lambda: store.set(f"{_ERROR}{rank}", f"{type(error).__name__}: {error}"[:2000]))


def mark_ready(store: dist.Store, rank: int) -> None:
    """This rank loaded the artifact and built its program: it is about to join the process group."""
    store.set(f"{_READY}{rank}", "1")


def wait_until_ready(store: dist.Store, world_size: int, local_failures: dict[int, str], timeout_s: float
                     ) -> list[str]:
    """Wait until ranks 1..world_size-1 are ready; the causes (as `diagnose` words them) if any failed first.

    Joining the process group blocks until every rank joins, so a rank that
    fails while loading must be seen here, before rank 0 waits there.
    """
    deadline = time.monotonic() + timeout_s
    waiting = set(range(1, world_size))
    while waiting and time.monotonic() < deadline:
        waiting = {rank for rank in waiting if _read(store, f"{_READY}{rank}") is None}
        failed = [rank for rank in waiting if rank in local_failures or _read(store, f"{_EXIT}{rank}") is not None
                  or _read(store, f"{_ERROR}{rank}") is not None]
        if failed:
            time.sleep(0.2)  # let the error record of a rank whose exit was seen first arrive
            return diagnose(store, world_size, dict(local_failures), wait_s=0.0)
        time.sleep(0.05)
    if waiting:
        return [f"rank {rank} did not start within {timeout_s:.0f}s" for rank in sorted(waiting)]
    return []


class Heartbeat:
    """Bumps this rank's heartbeat counter every HEARTBEAT_INTERVAL_S on a thread of its own, until `stop`.

    `stop` must run before the process ends: a daemon thread still inside a
    store call (which releases the GIL) when the interpreter finalizes is
    ended by the runtime as it tries to take the GIL back, and unwinding it
    through c10d's C++ frames aborts the whole process (std::terminate).
    """

    JOIN_TIMEOUT_S = 10.0

    def __init__(self, store: dist.Store, rank: int):
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(store, f"{_HEARTBEAT}{rank}"),
                                        name=f"octavo-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self, store: dist.Store, key: str) -> None:
        while not self._stopping.is_set():
            try:
                store.add(key, 1)
            except Exception:  # the store (rank 0) is gone: nobody is listening any more
                return
            self._stopping.wait(HEARTBEAT_INTERVAL_S)

    def stop(self) -> None:
        """Stop beating and wait for a store call in flight to return."""
        self._stopping.set()
        self._thread.join(self.JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("the heartbeat's store call did not return within %.0fs", self.JOIN_TIMEOUT_S)


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def diagnose(store: dist.Store, world_size: int, local_failures: dict[int, str], wait_s: float = 1.0) -> list[str]:
    """Why ranks 1..world_size-1 are gone: the causes first; ranks that only lost a peer are left out
    when a cause is known. `local_failures` are the ones this process saw itself (rank -> how it ended).
    Takes about `wait_s` (to see which heartbeats still move; 0: exit and error records only)."""
    before = _heartbeats(store, world_size)
    time.sleep(wait_s)
    after = _heartbeats(store, world_size)
    causes, consequences = [], []
    for rank in range(1, world_size):
        ended = local_failures.get(rank) or _read(store, f"{_EXIT}{rank}")
        error = _read(store, f"{_ERROR}{rank}")
        if error is not None and any(marker in error for marker in _PEER_LOSS):
            consequences.append(f"rank {rank} lost a peer ({error})")
        elif error is not None:
            causes.append(f"rank {rank} failed: {error}")
        elif ended:
            causes.append(f"rank {rank} {ended}")
        elif wait_s > 0 and before.get(rank) is not None and before.get(rank) == after.get(rank):
            causes.append(f"rank {rank} stopped responding (no heartbeat for {wait_s:.1f}s)")
    return causes or consequences


def _heartbeats(store: dist.Store, world_size: int) -> dict[int, int | None]:
    return {rank: _read_int(store, f"{_HEARTBEAT}{rank}") for rank in range(1, world_size)}


def _read(store: dist.Store, key: str) -> str | None:
    try:
        if store.check([key]):
            return store.get(key).decode()
    except Exception:  # the store itself failing must not hide the original error
        logger.debug("could not read %s from the rendezvous store", key)
    return None


def _read_int(store: dist.Store, key: str) -> int | None:
    text = _read(store, key)
    return int(text) if text is not None and text.lstrip("-").isdigit() else None


def _quietly(action) -> None:
    try:
        action()
    except Exception:
        logger.debug("could not write to the rendezvous store", exc_info=True)
