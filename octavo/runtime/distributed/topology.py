"""Where the ranks of a parallel engine live: tensor x pipeline layout, nodes, the rendezvous address."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from octavo.config import EngineConfig, RankPosition


@dataclass(frozen=True)
class Topology:
    """tp_size x pp_size ranks over `nnodes` nodes, `ranks_per_node` each (node n holds ranks n*k .. n*k+k-1).

    Global rank = stage * tp_size + tp_rank (see RankPosition); rank 0 (node 0)
    runs the scheduler, the sampler and the server. `init_method` is the
    tcp://HOST:PORT every rank meets at (node 0 hosts it).
    """

    tp_size: int
    pp_size: int
    nnodes: int
    node_rank: int
    init_method: str

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def position(self, rank: int) -> RankPosition:
        return RankPosition.of_rank(rank, self.tp_size, self.pp_size)

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp_size, (stage + 1) * self.tp_size))

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def next_in_pipeline(self, rank: int) -> int | None:
        """The rank of the next stage with the same tensor-parallel index, or None on the last stage."""
        return rank + self.tp_size if rank + self.tp_size < self.world_size else None

    def previous_in_pipeline(self, rank: int) -> int | None:
        return rank - self.tp_size if rank >= self.tp_size else None

    @property
    def last_stage_first_rank(self) -> int:
        """The rank that sends the logits to rank 0 (tensor-parallel index 0 of the last stage)."""
        return (self.pp_size - 1) * self.tp_size


def topology_of(config: EngineConfig) -> Topology:
    """The layout `config` asks for; on one machine without an address, a free loopback port."""
    init_method = config.distributed_init or f"tcp://127.0.0.1:{free_port()}"
    return Topology(config.tensor_parallel_size, config.pipeline_parallel_size, config.nnodes, config.node_rank,
                    init_method)


def free_port() -> int:
    """A TCP port nothing listens on right now (bound and released; the rendezvous binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
