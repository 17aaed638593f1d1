"""How the ranks of a parallel engine are laid out: tensor x pipeline parallel, and who talks to whom."""

from __future__ import annotations

from dataclasses import dataclass

from octavo.config import EngineConfig, RankPosition


@dataclass(frozen=True)
class Topology:
    """tp_size x pp_size ranks; global rank = stage * tp_size + tp_rank (see RankPosition).

    Rank 0 runs the scheduler, the sampler and the server, and is stage 0's
    first tensor-parallel rank. Where the ranks run (nodes, devices) is the
    launcher's business, not the layout's (see rendezvous).
    """

    tp_size: int
    pp_size: int

    @classmethod
    def of(cls, config: EngineConfig) -> Topology:
        return cls(config.tensor_parallel_size, config.pipeline_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def position(self, rank: int) -> RankPosition:
        return RankPosition.of_rank(rank, self.tp_size, self.pp_size)

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp_size, (stage + 1) * self.tp_size))

    def next_in_pipeline(self, rank: int) -> int | None:
        """The rank of the next stage with the same tensor-parallel index, or None on the last stage."""
        return rank + self.tp_size if rank + self.tp_size < self.world_size else None

    def previous_in_pipeline(self, rank: int) -> int | None:
        return rank - self.tp_size if rank >= self.tp_size else None

    @property
    def last_stage_first_rank(self) -> int:
        """The rank that sends the logits to rank 0 (tensor-parallel index 0 of the last stage)."""
        return (self.pp_size - 1) * self.tp_size
