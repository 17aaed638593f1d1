"""Ray as the executor of a parallel engine: one actor per worker rank, placed by a placement group.

``octavo serve A -tp 4 --distributed-executor ray`` on a Ray cluster (``ray
start --head``, then ``ray start --address HEAD:6379`` on the other machines;
without a cluster, a local one is started for the engine's lifetime): the
server process is rank 0; ranks 1..N-1 are actors, one per bundle of a
placement group (one CPU each, and one GPU each where rank 0 runs on CUDA),
packed onto as few nodes as fit. Every actor runs the same rank program and
step protocol as a process of Octavo's own launcher; it meets the others at
a rendezvous on rank 0's node. A driver thread waits on every actor's run: an
actor that dies (its process killed, its node lost) or raises marks the
engine failed, naming the rank, so the server answers 503.

Ray is optional: ``pip install 'octavo[ray]'``.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid

from octavo.config import EngineConfig
from octavo.errors import OctavoError
from octavo.parallel.programs import program_of
from octavo.parallel.rank import WorkerSpec, run_rank
from octavo.runtime.distributed.launch import RankLaunch, WorkerStart
from octavo.runtime.distributed.launcher import call_exit_callback
from octavo.runtime.distributed.rendezvous import Rendezvous, free_port, launched_rendezvous
from octavo.runtime.engine import resolve_device

logger = logging.getLogger(__name__)

NAMESPACE = "octavo"
"""The Ray namespace of the engine's actors; each is named octavo-<run id>-rank-<rank>."""


def import_ray():
    try:
        import ray
    except ImportError as error:
        raise OctavoError("--distributed-executor ray needs the ray package: pip install 'octavo[ray]'") from error
    return ray


class RankActor:
    """The Ray actor of one worker rank (made a remote class by `ray_launch`)."""

    def placement(self) -> tuple[str, int]:
        """(node id, pid) of this actor's process."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def run(self, spec: str, environment: dict[str, str]) -> None:
        """Run the rank until the engine shuts down (raises what the rank raised)."""
        os.environ.update(environment)
        worker = WorkerSpec.from_json(spec)
        logging.basicConfig(level=worker.log_level,
                            format=f"%(levelname)s rank {environment['RANK']} %(name)s: %(message)s")
        run_rank(worker.artifact, worker.engine_config, launched_rendezvous(), worker.backend, worker.device,
                 worker.verify)


class RayWorkers:
    """The worker group of Ray actors (see the module docstring)."""

    def __init__(self, ray, actors: dict[int, object], placement_group, started_ray: bool):
        self.ray = ray
        self.actors = actors
        self.placement_group = placement_group
        self.started_ray = started_ray
        self.ended: dict[int, str | None] = {}
        self._done = threading.Event()

    def start(self, spec: str, rendezvous_of: dict[int, Rendezvous], start: WorkerStart) -> RayWorkers:
        runs = {self.actors[rank].run.remote(spec, rendezvous.environment()): rank
                for rank, rendezvous in rendezvous_of.items()}
        threading.Thread(target=self._watch, args=(runs, start), name="octavo-ray-watcher", daemon=True).start()
        return self

    def _watch(self, runs: dict, start: WorkerStart) -> None:
        pending = list(runs)
        while pending:
            done, pending = self.ray.wait(pending, num_returns=1)
            rank = runs[done[0]]
            try:
                self.ray.get(done[0])
                failure = None
            except self.ray.exceptions.RayActorError as error:
                failure = f"(Ray actor) died: {_first_line(error)}"
            except self.ray.exceptions.RayTaskError as error:
                failure = f"(Ray actor) failed: {_first_line(error.cause if error.cause else error)}"
            self.ended[rank] = failure
            call_exit_callback(start.on_exit, rank, failure)
        self._done.set()

    @property
    def failures(self) -> dict[int, str]:
        return {rank: failure for rank, failure in dict(self.ended).items() if failure is not None}

    def terminate(self) -> None:
        for actor in self.actors.values():
            self.ray.kill(actor)

    def join(self, timeout: float) -> None:
        """Wait for the actors' runs to end (after the shutdown message), then release the actors and the group."""
        self._done.wait(timeout)
        self.terminate()
        self.ray.util.remove_placement_group(self.placement_group)
        if self.started_ray:
            self.ray.shutdown()


def ray_launch(config: EngineConfig) -> RankLaunch:
    """Place ranks 1..N-1 as actors (this process is rank 0) and say how to start them."""
    ray = import_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=os.environ.get("RAY_ADDRESS"), namespace=NAMESPACE, logging_level=logging.WARNING,
                 include_dashboard=False)
    on_gpu = resolve_device(config.device).type == "cuda"
    bundle = {"CPU": float(config.num_threads or 1), **({"GPU": 1.0} if on_gpu else {})}
    workers = range(1, config.world_size)
    group = placement_group([dict(bundle) for _ in workers], strategy="PACK")
    if not group.wait(timeout_seconds=config.rendezvous_timeout):
        ray.util.remove_placement_group(group)
        raise OctavoError(f"the Ray cluster has no room for {len(workers)} rank(s) of {bundle} each "
                          f"(resources: {ray.cluster_resources()})")
    run_id = uuid.uuid4().hex[:8]
    remote = ray.remote(RankActor)
    actors = {rank: remote.options(name=f"octavo-{run_id}-rank-{rank}", namespace=NAMESPACE, max_concurrency=2,
                                   num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                   scheduling_strategy=PlacementGroupSchedulingStrategy(group, index)).remote()
              for index, rank in enumerate(workers)}
    nodes = {}
    for rank, actor in actors.items():
        nodes[rank], pid = ray.get(actor.placement.remote())
        logger.info("rank %d: Ray actor octavo-%s-rank-%d (pid %d) on node %s", rank, run_id, rank, pid, nodes[rank])
    nodes[0] = ray.get_runtime_context().get_node_id()
    address = ray.util.get_node_ip_address()
    rendezvous = _rendezvous_by_rank(nodes, config.world_size, address, free_port(address), run_id)
    ray_workers = RayWorkers(ray, actors, group, started_ray)

    def start_workers(start: WorkerStart) -> RayWorkers:
        spec = WorkerSpec.of(start.artifact, config, start.backend, start.device_type, verify=True)
        return ray_workers.start(spec.to_json(), {rank: rendezvous[rank] for rank in workers}, start)

    return RankLaunch(rendezvous[0], program_of, start_workers)


def _rendezvous_by_rank(nodes: dict[int, str], world_size: int, address: str, port: int,
                        run_id: str) -> dict[int, Rendezvous]:
    """Each rank's rendezvous: its local rank and its node's rank count follow where Ray placed it."""
    by_node: dict[str, list[int]] = {}
    for rank in range(world_size):
        by_node.setdefault(nodes[rank], []).append(rank)
    return {rank: Rendezvous(rank, world_size, by_node[nodes[rank]].index(rank), len(by_node[nodes[rank]]),
                             address, port, "ray", run_id=f"ray-{run_id}") for rank in range(world_size)}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
