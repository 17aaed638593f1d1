"""A worker rank: meet the others, build this rank's program, then run each step rank 0 sends until told to stop.

The rank's program (its shard of the graph and weights) comes from the
caller: sharding runs the parallel passes, which live above the runtime.
Whoever started the process (Octavo's launcher, torchrun, srun, a Ray actor)
calls `run_worker`; an error is recorded in the rendezvous store before it
propagates, so that rank 0 can name it. A worker whose peers vanish fails
its next wait at once (their connections close) and returns the error; it
never outlives rank 0 for longer than that.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from octavo.config import EngineConfig
from octavo.runtime.distributed.rendezvous import Rendezvous
from octavo.runtime.distributed.topology import Topology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerOptions:
    """What a worker needs besides its rendezvous: the engine's options and where it computes."""

    config: EngineConfig
    backend: str
    device: torch.device


def threads_per_rank(config: EngineConfig, local_world_size: int) -> int:
    """config.num_threads, else the cores this process may use shared evenly between the node's ranks."""
    if config.num_threads:
        return config.num_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local_world_size)


def run_worker(rendezvous: Rendezvous, options: WorkerOptions, build_program: Callable[[], tuple[dict, object]]
               ) -> None:
    """Serve steps as rank `rendezvous.rank` until rank 0 sends the shutdown message.

    `build_program()` loads the artifact and returns its manifest and this rank's
    program (a RankProgram of octavo.passes.rank_program).
    """
    from octavo.runtime.distributed.collectives import init_groups, open_store
    from octavo.runtime.distributed.failures import Heartbeat, mark_ready, record_error
    from octavo.runtime.distributed.protocol import SHUTDOWN
    from octavo.runtime.distributed.rank_state import build_rank_state, run_step, step_input_dtypes, step_input_names
    from octavo.runtime.distributed.transport import StepTransport

    config = options.config
    torch.set_num_threads(threads_per_rank(config, rendezvous.local_world_size))
    store = open_store(rendezvous, config.rendezvous_timeout)
    heartbeat = Heartbeat(store, rendezvous.rank)
    try:
        manifest, program = build_program()
        mark_ready(store, rendezvous.rank)
        groups = init_groups(Topology.of(config), rendezvous, store, config.collective_timeout,
                             config.rendezvous_timeout, options.device)
        state = build_rank_state(program, manifest, groups, config, options.backend, options.device)
        transport = StepTransport(groups, step_input_names(manifest), step_input_dtypes(manifest), options.device)
        sends_logits = program.pipeline_stage is None or not program.pipeline_stage["outputs"]
        sends_logits = sends_logits and program.position.tp_rank == 0
        while True:
            message = transport.receive_step()
            if message.opcode == SHUTDOWN:
                transport.flush()
                break
            logits = run_step(state, transport, message)
            if logits is not None and sends_logits:
                transport.send_logits(logits)
    except BaseException as error:
        record_error(store, rendezvous.rank, error)
        raise
    finally:
        heartbeat.stop()
