"""Who starts the ranks of a parallel engine: an external launcher, Octavo's own (mp), or Ray.

- External (torchrun, srun, or any launcher that sets RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT): every rank runs the same command. Rank 0 builds
  the engine and serves or prints; every other rank runs its rank program
  in its own process (`follow`) until rank 0 shuts the engine down. The
  launcher watches the processes and ends them all when one fails.
- mp: rank 0 starts the worker ranks of its node as processes
  (``python -m octavo.parallel.worker``); with several nodes, every other
  node runs the same command with its --node-rank and starts its own ranks.
- ray: rank 0 places one actor per other rank on a Ray cluster (see ray_workers).
"""

from __future__ import annotations

import os
from pathlib import Path

from octavo.config import EngineConfig
from octavo.errors import OctavoError
from octavo.parallel.programs import program_of
from octavo.parallel.rank import WorkerSpec, run_rank
from octavo.runtime.distributed.failures import record_exit
from octavo.runtime.distributed.launch import NoWorkers, RankLaunch, WorkerStart
from octavo.runtime.distributed.launcher import LocalWorkers
from octavo.runtime.distributed.rendezvous import Rendezvous, free_port, launched_rendezvous
from octavo.runtime.engine import resolve_backend, resolve_device

WORKER_MODULE = "octavo.parallel.worker"


def distributed_executor(config: EngineConfig) -> str:
    """"external", "mp" or "ray": who starts the ranks of `config`'s engine in this process."""
    rendezvous = launched_rendezvous()
    if rendezvous is not None:
        if config.distributed_executor != "auto":
            raise OctavoError(f"this process was started as rank {rendezvous.rank} of {rendezvous.world_size} by "
                              f"{rendezvous.launcher}; --distributed-executor {config.distributed_executor} would "
                              "start the ranks a second time (leave it at auto)")
        check_world_size(config, rendezvous)
        return "external"
    return "mp" if config.distributed_executor == "auto" else config.distributed_executor


def check_world_size(config: EngineConfig, rendezvous: Rendezvous) -> None:
    if rendezvous.world_size != config.world_size:
        raise OctavoError(f"{rendezvous.launcher} started {rendezvous.world_size} ranks (WORLD_SIZE), but "
                          f"--tensor-parallel-size {config.tensor_parallel_size} x --pipeline-parallel-size "
                          f"{config.pipeline_parallel_size} needs {config.world_size}")


def rank_launch(config: EngineConfig) -> RankLaunch | None:
    """How rank 0's engine starts the others; None for a single-process engine."""
    if config.world_size == 1:
        rendezvous = launched_rendezvous()
        if rendezvous is not None and rendezvous.world_size > 1:
            check_world_size(config, rendezvous)
        return None
    executor = distributed_executor(config)
    if executor == "external":
        rendezvous = launched_rendezvous()
        if rendezvous.rank != 0:
            raise OctavoError(f"rank {rendezvous.rank} runs no engine: it follows rank 0 (octavo.parallel.follow)")
        return RankLaunch(rendezvous, program_of, lambda start: NoWorkers())
    if executor == "ray":
        from octavo.parallel.ray_workers import ray_launch

        return ray_launch(config)
    rendezvous = own_rendezvous(config, rank=0)
    return RankLaunch(rendezvous, program_of, lambda start: _start_local_workers(config, rendezvous, start))


def own_rendezvous(config: EngineConfig, rank: int) -> Rendezvous:
    """The rendezvous of `rank` under Octavo's own launcher (node 0 hosts it at --distributed-init)."""
    if config.distributed_init:
        host, _, port = config.distributed_init.removeprefix("tcp://").rpartition(":")
        if not port.isdigit():
            raise OctavoError(f"distributed_init must be tcp://HOST:PORT, got {config.distributed_init!r}")
        address = (host, int(port))
    else:
        address = ("127.0.0.1", free_port())
    per_node = config.world_size // config.nnodes
    return Rendezvous(rank, config.world_size, rank % per_node, per_node, address[0], address[1], "octavo",
                      run_id=f"{address[0]}-{address[1]}")


def _local_ranks(config: EngineConfig) -> range:
    per_node = config.world_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def _start_local_workers(config: EngineConfig, rendezvous: Rendezvous, start: WorkerStart) -> LocalWorkers:
    spec = WorkerSpec.of(start.artifact, config, start.backend, start.device_type, verify=False)
    ranks = [rank for rank in _local_ranks(config) if rank != 0]
    return LocalWorkers(WORKER_MODULE, spec.to_json(),
                        {rank: rendezvous.for_rank(rank, rank % rendezvous.local_world_size) for rank in ranks},
                        on_exit=start.on_exit)


def follow(artifact: str | os.PathLike, config: EngineConfig) -> int | None:
    """Run the ranks this process owes an engine whose rank 0 runs elsewhere; the exit code, or None on rank 0.

    None: this process is rank 0 (or a single-process engine): build the engine.
    Otherwise this process is a follower: a rank other than 0 started by
    torchrun or srun (it runs its rank here), or a node other than node 0 of
    Octavo's own multi-node launcher (it starts its node's ranks and waits).
    """
    if config.world_size == 1:
        rank_launch(config)  # only checks that no launcher started more ranks than the engine has
        return None
    executor = distributed_executor(config)
    if executor == "external":
        rendezvous = launched_rendezvous()
        if rendezvous.rank == 0:
            return None
        device = resolve_device(config.device)
        run_rank(artifact, config, rendezvous, resolve_backend(config.backend, device), device.type, verify=True)
        return 0
    if executor == "mp" and config.node_rank > 0:
        return _run_worker_node(Path(artifact), config)
    return None


def _run_worker_node(artifact: Path, config: EngineConfig) -> int:
    """Node R > 0 of Octavo's multi-node launcher: start this node's ranks, record their exits, wait for them."""
    from octavo.runtime.distributed.collectives import open_store

    if not config.distributed_init:
        raise OctavoError("a worker node needs --distributed-init tcp://HOST:PORT of node 0")
    ranks = list(_local_ranks(config))
    rendezvous = own_rendezvous(config, ranks[0])
    device = resolve_device(config.device)
    spec = WorkerSpec.of(artifact.expanduser().resolve(), config, resolve_backend(config.backend, device),
                         device.type, verify=True)
    store = open_store(rendezvous, config.rendezvous_timeout)
    workers = LocalWorkers(WORKER_MODULE, spec.to_json(),
                           {rank: rendezvous.for_rank(rank, rank % rendezvous.local_world_size) for rank in ranks},
                           on_exit=lambda rank, failure: record_exit(store, rank, failure))
    ends = workers.wait_all()
    return 0 if all(failure is None for failure in ends.values()) else 1
