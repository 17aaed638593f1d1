"""Process groups of a parallel engine, and the lowering of octavo collectives to torch.distributed.

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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.fx import GraphModule

from octavo.errors import OctavoError
from octavo.ir.graph import find_nodes
from octavo.runtime.distributed.topology import Topology

logger = logging.getLogger(__name__)

octavo = torch.ops.octavo
functional = torch.ops._c10d_functional

IDLE_TIMEOUT = datetime.timedelta(days=30)
"""How long a rank waits for the next step (an idle engine sends nothing; a dead peer still fails at once)."""
STARTUP_TIMEOUT = datetime.timedelta(minutes=10)
"""How long ranks wait for each other to reach the rendezvous (loading, other nodes starting)."""


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
    def logical_groups(self) -> dict[str, str]:
        """Logical group name (as the parallel passes write it) -> the process group's registered name."""
        return {"tp": self.tp_group.group_name}


def backend_for(device: torch.device) -> str:
    """gloo on CPU; on CUDA, NCCL for device tensors and gloo for the host-side step messages."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def connect_store(topology: Topology, rank: int) -> dist.TCPStore:
    """The rendezvous store: rank 0 hosts it at topology.init_method, the others connect (waiting for it)."""
    host, _, port = topology.init_method.removeprefix("tcp://").rpartition(":")
    try:
        return dist.TCPStore(host, int(port), topology.world_size, is_master=rank == 0, timeout=STARTUP_TIMEOUT,
                             wait_for_workers=False)
    except (RuntimeError, ValueError) as error:
        raise OctavoError(f"rank {rank} could not reach the rendezvous at {topology.init_method}: {error}") from error


def init_groups(topology: Topology, rank: int, store: dist.TCPStore, timeout_s: float,
                device: torch.device) -> RankGroups:
    """Join the process group of all ranks through `store` and create the tensor-parallel groups."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(backend_for(device), store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=topology.world_size, timeout=max(timeout, STARTUP_TIMEOUT))
    except (RuntimeError, ValueError) as error:
        raise OctavoError(f"rank {rank} could not join the process group at {topology.init_method}: {error}") \
            from error
    tp_groups = [dist.new_group(topology.stage_ranks(stage), timeout=timeout) for stage in range(topology.pp_size)]
    stage = topology.position(rank).pp_rank
    return RankGroups(rank, topology, tp_groups[stage], store, timeout)


def destroy_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def lower_collectives(graph_module: GraphModule, group_names: dict[str, str]) -> GraphModule:
    """Replace octavo.all_reduce / all_gather by torch.distributed's functional collectives (in place).

    ``all_reduce(x, g, n)`` becomes ``wait_tensor(all_reduce(x, "sum", name_of[g]))``;
    ``all_gather(x, g, n, dim)`` gathers along dim 0 (``all_gather_into_tensor``)
    and, for another dim, re-joins the rank blocks along it
    (``cat(split(gathered, x.size(0)), dim)``). Fails naming an unknown group.
    """
    graph = graph_module.graph
    for node in find_nodes(graph_module, octavo.all_reduce.default):
        value, group, _ = node.args
        with graph.inserting_before(node):
            started = graph.call_function(functional.all_reduce.default, (value, "sum", _name(group_names, group)))
            done = graph.call_function(functional.wait_tensor.default, (started,))
        node.replace_all_uses_with(done)
        graph.erase_node(node)
    for node in find_nodes(graph_module, octavo.all_gather.default):
        value, group, world_size, dim = node.args
        with graph.inserting_before(node):
            contiguous = graph.call_function(torch.ops.aten.clone.default, (value,),
                                             {"memory_format": torch.contiguous_format})
            started = graph.call_function(functional.all_gather_into_tensor.default,
                                          (contiguous, world_size, _name(group_names, group)))
            result = graph.call_function(functional.wait_tensor.default, (started,))
            if dim != 0:
                rows = graph.call_function(torch.ops.aten.sym_size.int, (value, 0))
                blocks = graph.call_function(torch.ops.aten.split.Tensor, (result, rows, 0))
                result = graph.call_function(torch.ops.aten.cat.default, (blocks, dim))
        node.replace_all_uses_with(result)
        graph.erase_node(node)
    graph_module.recompile()
    return graph_module


def _name(group_names: dict[str, str], group: str) -> str:
    if group not in group_names:
        raise OctavoError(f"the graph uses collective group {group!r}, which this engine does not have "
                          f"({', '.join(sorted(group_names))})")
    return group_names[group]
