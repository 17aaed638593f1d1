"""The rendezvous store and process groups of a parallel engine, and the lowering of octavo's collectives.

Every collective has a deadline. Groups that carry a step's computation
(tensor-parallel collectives, payloads, hidden states, logits) use the
engine's `collective_timeout`; the groups on which a rank waits for the
*next* step use a long one, because an idle server sends nothing for as
long as it is idle. A peer that dies closes its connections, which fails
the operations waiting on it at once, whatever their deadline.
"""

from __future__ import annotations

import datetime
import logging
import re
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.fx import GraphModule

from octavo.errors import OctavoError
from octavo.ir.graph import find_nodes
from octavo.runtime.distributed.devices import bind_device
from octavo.runtime.distributed.rank_collectives import bind_groups, unbind_groups
from octavo.runtime.distributed.rendezvous import Rendezvous
from octavo.runtime.distributed.shm_groups import open_shared_memory_group
from octavo.runtime.distributed.topology import Topology

logger = logging.getLogger(__name__)

octavo = torch.ops.octavo
octavo_rank = torch.ops.octavo_rank

IDLE_TIMEOUT = datetime.timedelta(days=30)
"""How long a rank waits for the next step (an idle engine sends nothing; a dead peer still fails at once)."""


@dataclass
class RankGroups:
    """What one rank communicates through: its tensor-parallel group, the world group, the rendezvous store.

    All ranks create all tensor-parallel groups, in the same order. Point to
    point messages (step headers and payloads along the pipeline, hidden
    states, logits) use the world group; waits for the next step pass
    IDLE_TIMEOUT explicitly, everything else runs under `timeout`.
    """

    rank: int
    topology: Topology
    tp_group: dist.ProcessGroup
    store: dist.Store
    timeout: datetime.timedelta

    @property
    def logical_groups(self) -> dict[str, dist.ProcessGroup]:
        """Logical group name (as the parallel passes write it) -> this rank's process group of that name."""
        return {"tp": self.tp_group}


def backend_for(device: torch.device) -> str:
    """gloo on CPU; on CUDA, NCCL for device tensors and gloo for the host-side step messages."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def open_store(rendezvous: Rendezvous, timeout_s: float) -> dist.Store:
    """The rendezvous store, as ``init_method="env://"`` opens it: rank 0 hosts it at MASTER_ADDR:MASTER_PORT
    (unless torchelastic's agent does), the others connect, each waiting up to `timeout_s` for it.

    Returns the store under this launch's key prefix; fails in one line naming the address.
    """
    hosts = rendezvous.rank == 0 and not rendezvous.agent_store
    if not hosts:
        wait_for_listener(rendezvous, timeout_s)
    try:
        store = dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, rendezvous.world_size,
                              is_master=hosts, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
    except (RuntimeError, ValueError) as error:
        what = "could not listen for" if hosts else "could not join"
        raise OctavoError(f"rank {rendezvous.rank} {what} the rendezvous at {rendezvous.endpoint}: "
                          f"{_first_line(error)}") from error
    return dist.PrefixStore(rendezvous.store_prefix, store)


def wait_for_listener(rendezvous: Rendezvous, timeout_s: float) -> None:
    """Wait until something listens at the rendezvous address, or fail in one line after `timeout_s`.

    (c10d's own client retries print a stack trace per attempt; a plain connection probe does not.)
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((rendezvous.master_addr, rendezvous.master_port),
                                          timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                reason = error.strerror or type(error).__name__
                raise OctavoError(f"rank {rendezvous.rank} could not reach the rendezvous at {rendezvous.endpoint} "
                                  f"within {timeout_s:g}s ({reason}): is rank 0 running there? MASTER_ADDR and "
                                  "MASTER_PORT must be the same for every rank") from None
            time.sleep(0.2)


def init_groups(topology: Topology, rendezvous: Rendezvous, store: dist.Store, timeout_s: float,
                startup_timeout_s: float, device: torch.device) -> RankGroups:
    """Join the process group of all ranks through `store` and create the tensor-parallel groups.

    `timeout_s` bounds the waits within a step, `startup_timeout_s` the joining. On CUDA the rank's
    device is made current first, so that NCCL's communicators use it.
    """
    rank = rendezvous.rank
    timeout = datetime.timedelta(seconds=timeout_s)
    bind_device(device)
    try:
        dist.init_process_group(backend_for(device), store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=topology.world_size,
                                timeout=max(timeout, datetime.timedelta(seconds=startup_timeout_s)))
    except (RuntimeError, ValueError) as error:
        raise OctavoError(f"rank {rank} could not join the process group at {rendezvous.endpoint}: "
                          f"{_first_line(error)}") from error
    tp_groups = [dist.new_group(topology.stage_ranks(stage), timeout=timeout) for stage in range(topology.pp_size)]
    stage = topology.position(rank).pp_rank
    groups = RankGroups(rank, topology, tp_groups[stage], store, timeout)
    shared = {name: open_shared_memory_group(group, timeout) for name, group in groups.logical_groups.items()}
    bind_groups(groups.logical_groups, {name: group for name, group in shared.items() if group is not None})
    return groups


def destroy_groups() -> None:
    unbind_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def _first_line(error: BaseException) -> str:
    """The first line of an error from c10d, without its source-location prefix."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[[^\]]*\] ", "", text)


def lower_collectives(graph_module: GraphModule) -> GraphModule:
    """Replace octavo.all_reduce / all_gather by octavo_rank's ops on the logically named group (in place).

    ``all_reduce(x, g, n)`` becomes ``octavo_rank.all_reduce(x, g)`` and
    ``all_gather(x, g, n, dim)`` becomes ``octavo_rank.all_gather(x, g, n, dim)``:
    the group stays a logical name, bound to a process group when the step runs
    (see rank_collectives).
    """
    graph = graph_module.graph
    for node in find_nodes(graph_module, octavo.all_reduce.default):
        value, group, _ = node.args
        node.target = octavo_rank.all_reduce.default
        node.args = (value, group)
    for node in find_nodes(graph_module, octavo.all_gather.default):
        node.target = octavo_rank.all_gather.default
    graph.lint()
    graph_module.recompile()
    return graph_module
