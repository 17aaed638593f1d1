"""Rank 0 of a parallel engine: starts the other ranks, runs stage 0 itself, and stands in for the executor.

The engine keeps its interface: `ParallelRuntime.executor.run(inputs)` runs
one step on every rank and returns the logits; `ParallelRuntime.kv_cache` is
rank 0's share of the cache, and the block moves the engine makes on it are
sent to every rank with the next step. `submit` / `collect` split a step so
that a pipeline can hold several in flight.
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
import weakref
from dataclasses import dataclass

import torch

from octavo.config import EngineConfig
from octavo.errors import OctavoError, WorkerFailedError
from octavo.runtime.distributed.collectives import destroy_groups, init_groups, open_store
from octavo.runtime.distributed.failures import diagnose, record_exit, wait_until_ready
from octavo.runtime.distributed.launch import RankLaunch, WorkerStart
from octavo.runtime.distributed.protocol import SHUTDOWN, STEP, StepMessage
from octavo.runtime.distributed.rank_state import build_rank_state, run_step, step_input_dtypes, step_input_names
from octavo.runtime.distributed.topology import Topology
from octavo.runtime.distributed.transport import StepTransport
from octavo.runtime.distributed.worker import threads_per_rank
from octavo.runtime.kv_cache import KVCache
from octavo.runtime.loader import LoadedArtifact

logger = logging.getLogger(__name__)


class RecordingKVCache(KVCache):
    """Rank 0's KV cache: performs block moves like KVCache and remembers them for the next step message."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.moves: dict[str, list[tuple[int, int]]] = {"copies": [], "swap_out": [], "swap_in": []}

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.moves["copies"] += pairs
        super().copy_blocks(pairs)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self.moves["swap_out"] += pairs
        super().swap_out(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self.moves["swap_in"] += pairs
        super().swap_in(pairs)

    def take_moves(self) -> dict[str, list[tuple[int, int]]]:
        moves, self.moves = self.moves, {"copies": [], "swap_out": [], "swap_in": []}
        return moves


@dataclass
class InFlightStep:
    """A submitted step: its logits when rank 0 computed them, else what rank 0 needs to receive them."""

    step: int
    logits: torch.Tensor | None
    num_rows: int


class ParallelRuntime:
    """Rank 0's side of a tensor x pipeline parallel engine (see the module docstring)."""

    def __init__(self, artifact: LoadedArtifact, config: EngineConfig, backend: str, device: torch.device,
                 launch: RankLaunch):
        self.config = config
        self.topology = Topology.of(config)
        self.rendezvous = launch.rendezvous
        if self.rendezvous.rank != 0 or self.rendezvous.world_size != self.topology.world_size:
            raise OctavoError(f"the engine runs on rank 0 of {self.topology.world_size} ranks, not on rank "
                              f"{self.rendezvous.rank} of {self.rendezvous.world_size}")
        if torch.distributed.is_initialized():
            raise OctavoError("this process already runs a parallel engine (one per process): shut it down first")
        self.manifest = artifact.manifest
        self.failure: WorkerFailedError | None = None
        self.closed = False
        self._lock = threading.Lock()
        torch.set_num_threads(threads_per_rank(config, self.rendezvous.local_world_size))
        # Build rank 0's program before any worker starts: a size that does not divide fails here, at once.
        program = launch.prepare_program(artifact, self.topology.position(0))
        self.store = open_store(self.rendezvous, config.rendezvous_timeout)
        self.workers = launch.start_workers(WorkerStart(artifact.path, backend, device.type, self._on_worker_exit))
        try:
            causes = wait_until_ready(self.store, self.topology.world_size, self.workers.failures,
                                      config.rendezvous_timeout)
            if causes:
                raise WorkerFailedError(f"distributed engine could not start: {'; '.join(causes)}")
            groups = init_groups(self.topology, self.rendezvous, self.store, config.collective_timeout,
                                 config.rendezvous_timeout, device)
            self.state = build_rank_state(program, self.manifest, groups, config, backend, device, RecordingKVCache)
        except Exception as error:
            failure = self._diagnosed(error, "start-up")
            self._abandon()
            self.workers.join(timeout=1.0)
            raise failure from error
        self.transport = StepTransport(groups, step_input_names(self.manifest), step_input_dtypes(self.manifest),
                                       device)
        self.executor = DistributedExecutor(self)
        self._step = 0
        finalizer = weakref.finalize(self, ParallelRuntime._shutdown_at_exit, weakref.ref(self))
        atexit.register(finalizer)
        logger.info("parallel engine: tensor parallel %d x pipeline parallel %d, launched by %s, rendezvous %s",
                    self.topology.tp_size, self.topology.pp_size, self.rendezvous.launcher, self.rendezvous.endpoint)

    @property
    def kv_cache(self) -> RecordingKVCache:
        return self.state.kv_cache

    @property
    def kv_layout(self) -> dict:
        """Rank 0's KV layout (its heads and its stage's layers)."""
        return self.state.program.kv_layout

    # ---- steps ----

    def submit(self, inputs: dict[str, torch.Tensor]) -> InFlightStep:
        """Send the step to every rank and run rank 0's part; the logits come with `collect`."""
        self._check_alive()
        moves = self.kv_cache.take_moves()
        step_inputs = {name: inputs[name].cpu() for name in self.transport.input_names}
        message = StepMessage(STEP, self._step, step_inputs, moves["copies"], moves["swap_out"], moves["swap_in"])
        self._step += 1
        try:
            self.transport.send_step(message)
            logits = run_step(self.state, self.transport, message, feed=dict(inputs))
        except Exception as error:
            raise self._fail(error, f"step {message.step}") from error
        return InFlightStep(message.step, logits, int(step_inputs["logits_indices"].shape[0]))

    def collect(self, handle: InFlightStep) -> torch.Tensor:
        """The logits of a submitted step (received from the last stage when rank 0 is not on it)."""
        if handle.logits is not None:
            return handle.logits
        self._check_alive()
        output = self.manifest["signature"]["outputs"]["logits"]
        try:
            return self.transport.receive_logits([handle.num_rows, int(output["shape"][-1])],
                                                 getattr(torch, output["dtype"]))
        except Exception as error:
            raise self._fail(error, f"step {handle.step}") from error

    # ---- failures and shutdown ----

    def _on_worker_exit(self, rank: int, failure: str | None) -> None:
        """From a watcher thread: a worker that dies marks the engine failed before any step notices."""
        record_exit(self.store, rank, failure)
        if failure is not None and not self.closed:
            with self._lock:
                if self.failure is None:
                    self.failure = WorkerFailedError(f"distributed engine stopped: rank {rank} {failure}")

    def _check_alive(self) -> None:
        if self.closed:
            raise OctavoError("the parallel engine was shut down")
        if self.failure is not None:
            raise self.failure

    def _fail(self, error: BaseException, during: str) -> WorkerFailedError:
        failure = self._diagnosed(error, during)
        with self._lock:
            self.failure = failure
        logger.error("%s", failure)
        self._abandon()
        return failure

    def _abandon(self) -> None:
        """After a failure: end this node's workers and close rank 0's connections, so that the ranks of other
        nodes, waiting for a next step that will not come, fail at once and their nodes exit."""
        self.workers.terminate()
        try:
            destroy_groups()
        except Exception as error:  # a broken group may not tear down cleanly; its sockets close with it anyway
            logger.debug("process group teardown after a failure: %s", error)

    def _diagnosed(self, error: BaseException, during: str) -> WorkerFailedError:
        if isinstance(error, WorkerFailedError):
            return error
        causes = diagnose(self.store, self.topology.world_size, self.workers.failures)
        what = "; ".join(causes) if causes else "a rank could not be reached"
        if not causes and self.rendezvous.launcher not in ("octavo", "ray"):
            what += f" ({self.rendezvous.launcher} reports which process ended)"
        return WorkerFailedError(f"distributed engine stopped during {during}: {what} ({short_error(error)})")

    def shutdown(self) -> None:
        """Tell every rank to stop, wait for this node's workers, leave the process group."""
        if self.closed:
            return
        self.closed = True
        if self.failure is None:
            try:
                self.transport.send_step(StepMessage(SHUTDOWN, self._step))
                self.transport.flush()
            except Exception as error:  # a rank that is already gone cannot be told
                logger.debug("shutdown message not delivered: %s", error)
        self.workers.join(timeout=0.5 if self.failure else 10.0)
        if self.failure is None:
            destroy_groups()

    @staticmethod
    def _shutdown_at_exit(reference) -> None:
        runtime = reference()
        if runtime is not None:
            runtime.shutdown()


def short_error(error: BaseException) -> str:
    """`Type: first line`, without gloo's source path prefix and advice."""
    text = str(error).splitlines()[0] if str(error) else ""
    text = re.sub(r"^\[[^\]]*\] ", "", text).split(". This is typically")[0]
    return f"{type(error).__name__}: {text}"


class DistributedExecutor:
    """The executor interface over all ranks: `run(inputs) -> logits` (rank 0's view of one step)."""

    def __init__(self, runtime: ParallelRuntime):
        self.runtime = runtime

    @property
    def kind(self) -> str:
        """The kind of executor every rank runs ("compiled" or "eager"; the ranks choose alike)."""
        return self.runtime.state.executor.kind

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.runtime.collect(self.runtime.submit(inputs))
