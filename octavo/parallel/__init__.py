"""Parallel engines: the layer that shards an artifact for each rank (the parallel passes) and starts the ranks.

It sits above the runtime and the passes, which do not know each other:
`create_engine` builds an LLMEngine whose ranks it starts (or joins, under
torchrun and srun), `follow` runs a process's ranks when the engine's rank 0
runs elsewhere. See docs/distributed.md.
"""

from __future__ import annotations

import os

from octavo.config import EngineConfig
from octavo.parallel.launch import follow, rank_launch
from octavo.runtime.engine import LLMEngine
from octavo.runtime.loader import LoadedArtifact


def create_engine(artifact: str | os.PathLike | LoadedArtifact, config: EngineConfig | None = None) -> LLMEngine:
    """An LLMEngine for `config`, one process or many ranks (this process is rank 0 of a parallel engine)."""
    config = config or EngineConfig()
    return LLMEngine(artifact, config, launch=rank_launch(config))


__all__ = ["create_engine", "follow"]
