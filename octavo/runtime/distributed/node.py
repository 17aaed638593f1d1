"""A node other than node 0 of a multi-node engine: it starts its worker ranks and waits for them.

`octavo serve ARTIFACT --distributed-init tcp://HOST:PORT --nnodes N --node-rank R`
(R > 0) lands here: node R runs ranks R*k .. R*k+k-1 (k = world size / N),
records every exit in the rendezvous store (so that rank 0 can name a rank
that died here) and returns when all of them have stopped: 0 when the
engine shut them down, 1 when any failed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from octavo.config import EngineConfig
from octavo.errors import OctavoError
from octavo.runtime.distributed.collectives import connect_store
from octavo.runtime.distributed.failures import describe_exit, record_exit
from octavo.runtime.distributed.launcher import LocalWorkers
from octavo.runtime.distributed.topology import topology_of
from octavo.runtime.distributed.worker import WorkerSpec

logger = logging.getLogger(__name__)


def run_worker_node(artifact: str, config: EngineConfig) -> int:
    """Run this node's ranks until they stop; the exit code for the command line."""
    from octavo.runtime.engine import resolve_backend, resolve_device

    if config.node_rank == 0 or not config.distributed_init:
        raise OctavoError("a worker node needs --node-rank R > 0 and --distributed-init tcp://HOST:PORT of node 0")
    root = Path(artifact).expanduser().resolve()
    topology = topology_of(config)
    device = resolve_device(config.device)
    backend = resolve_backend(config.backend, device)
    level = logging.getLogger("octavo").getEffectiveLevel()
    specs = [WorkerSpec(str(root), config, topology, rank, backend, str(device), verify=True, log_level=level)
             for rank in topology.local_ranks]
    store = connect_store(topology, topology.local_ranks[0])

    def on_exit(rank: int, exitcode: int) -> None:
        record_exit(store, rank, exitcode)
        if exitcode != 0:
            logger.error("rank %d %s", rank, describe_exit(exitcode))

    exits = LocalWorkers(specs, on_exit=on_exit).wait_all()
    return 0 if all(code == 0 for code in exits.values()) else 1
