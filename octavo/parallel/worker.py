"""The entry point of a worker rank: ``python -m octavo.parallel.worker SPEC``.

Octavo's launcher starts each worker rank this way, with the rendezvous in
the variables torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
...) and SPEC, a JSON object, for the rest: the artifact, the engine's
options, the backend and device kind rank 0 resolved. The process imports
Octavo only, never the program that started the engine.

Exit codes: 0 after the engine's shutdown message, 1 after any error (which
the rank records in the rendezvous store first, so that rank 0 can name it).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

from octavo.parallel.rank import WorkerSpec, run_rank
from octavo.runtime.distributed.launcher import PARENT_PID_ENV
from octavo.runtime.distributed.rendezvous import launched_rendezvous

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = WorkerSpec.from_json(argv[0])
    rendezvous = launched_rendezvous()
    logging.basicConfig(level=spec.log_level,
                        format=f"%(levelname)s rank {rendezvous.rank if rendezvous else '?'} %(name)s: %(message)s")
    _die_with_parent()
    # tqdm's default lock is a multiprocessing semaphore, which a killed worker would leak.
    from tqdm.std import tqdm

    tqdm.set_lock(threading.RLock())
    try:
        if rendezvous is None:
            raise RuntimeError("a worker rank needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
        run_rank(spec.artifact, spec.engine_config, rendezvous, spec.backend, spec.device, spec.verify)
    except BaseException as error:
        logger.error("stopped: %s: %s", type(error).__name__, error)
        sys.stderr.flush()
        os._exit(1)  # no interpreter teardown: the process group's threads may still block on dead peers
    sys.stderr.flush()
    os._exit(0)  # torch's interpreter teardown takes seconds on a loaded machine, and there is nothing to keep


def _die_with_parent() -> None:
    """On Linux, have the kernel kill this worker when the process that started it ends, however it ends."""
    parent = os.environ.get(PARENT_PID_ENV)
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(parent):  # the parent ended before the signal was armed
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
