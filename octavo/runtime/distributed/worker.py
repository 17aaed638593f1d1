"""A worker rank: load the artifact, build this rank's program, then run each step rank 0 sends until told to stop.

Exit codes: 0 after a shutdown message, 1 after any error (recorded in the
rendezvous store first, so that rank 0 can name it). A worker whose peers
vanish fails its next wait at once (their connections close) and exits; it
never outlives rank 0 for longer than that.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.std import tqdm

from octavo.config import EngineConfig
from octavo.ir.artifact_format import GRAPH, WEIGHTS
from octavo.runtime.distributed.topology import Topology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs (pickled to it by torch.multiprocessing)."""

    artifact: str
    config: EngineConfig
    topology: Topology
    rank: int
    backend: str
    device: str
    verify: bool
    log_level: int = logging.WARNING


def worker_main(spec: WorkerSpec) -> None:
    """The entry point of a spawned worker process."""
    logging.basicConfig(level=spec.log_level, format=f"%(levelname)s rank {spec.rank} %(name)s: %(message)s")
    # tqdm's default lock (every tqdm class shares tqdm.std's) is a multiprocessing semaphore, which a killed
    # worker would leak.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(threads_per_rank(spec.config, spec.topology))
    try:
        run_worker(spec)
    except BaseException as error:
        logger.error("rank %d stopped: %s: %s", spec.rank, type(error).__name__, error)
        sys.stderr.flush()
        os._exit(1)  # no interpreter teardown: the process group's threads may still block on dead peers
    sys.stderr.flush()
    os._exit(0)  # torch's interpreter teardown takes seconds on a loaded machine, and there is nothing to keep


def threads_per_rank(config: EngineConfig, topology: Topology) -> int:
    """config.num_threads, else this node's cores shared evenly between its ranks."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // topology.ranks_per_node)


def run_worker(spec: WorkerSpec) -> None:
    from octavo.passes.rank_program import prepare_rank_program
    from octavo.runtime.distributed.collectives import connect_store, init_groups
    from octavo.runtime.distributed.failures import mark_ready, record_error, start_heartbeat
    from octavo.runtime.distributed.protocol import SHUTDOWN
    from octavo.runtime.distributed.rank_state import build_rank_state, run_step, step_input_dtypes, step_input_names
    from octavo.runtime.distributed.transport import StepTransport

    store = connect_store(spec.topology, spec.rank)
    start_heartbeat(store, spec.rank)
    try:
        manifest, graph_module, weights = load_program_inputs(Path(spec.artifact), spec.verify)
        device = torch.device(spec.device)
        program = prepare_rank_program(graph_module, weights, manifest, spec.topology.position(spec.rank))
        mark_ready(store, spec.rank)
        groups = init_groups(spec.topology, spec.rank, store, spec.config.collective_timeout, device)
        state = build_rank_state(program, groups, spec.config, spec.backend, device,
                                 getattr(torch, manifest["dtype"]))
        transport = StepTransport(groups, step_input_names(manifest), step_input_dtypes(manifest), device)
        sends_logits = program.pipeline_stage is None or not program.pipeline_stage["outputs"]
        sends_logits = sends_logits and groups.topology.position(spec.rank).tp_rank == 0
        while True:
            message = transport.receive_step()
            if message.opcode == SHUTDOWN:
                transport.flush()
                break
            logits = run_step(state, transport, message)
            if logits is not None and sends_logits:
                transport.send_logits(logits)
    except BaseException as error:
        record_error(store, spec.rank, error)
        raise


def load_program_inputs(root: Path, verify: bool) -> tuple[dict, torch.fx.GraphModule, dict[str, torch.Tensor]]:
    """The manifest, graph and memory-mapped weights of an artifact (a worker needs no tokenizer)."""
    from octavo.ir.onnx_io import import_graph_from_onnx
    from octavo.runtime.loader import read_manifest, verify_files
    from octavo.runtime.weights import load_safetensors_mmap

    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest)
    return manifest, import_graph_from_onnx(root / GRAPH), load_safetensors_mmap(root / WEIGHTS)
