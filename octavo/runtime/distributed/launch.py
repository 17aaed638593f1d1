"""What a parallel engine needs from the layer above the runtime: rank 0's program, and how the other ranks start.

The runtime runs rank programs but does not make them: sharding an artifact
for a rank runs the parallel passes, which sit above it. The layer that may
use both (octavo.parallel) hands the engine a RankLaunch: rank 0's
rendezvous, a function that prepares a rank's program in this process, and
a function that starts the other ranks (Octavo's own launcher, Ray actors,
or nothing when torchrun or srun started them already).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from octavo.config import RankPosition
from octavo.runtime.distributed.rendezvous import Rendezvous
from octavo.runtime.loader import LoadedArtifact


class WorkerGroup(Protocol):
    """The worker ranks a launcher started for this engine (none, when an external launcher started them)."""

    @property
    def failures(self) -> dict[int, str]:
        """Ranks that ended badly, and how ("was killed by signal SIGKILL", "Ray actor died: ...")."""

    def terminate(self) -> None:
        """Stop every worker still running, now."""

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` for the workers to exit after a shutdown message, then stop the rest."""


class NoWorkers:
    """The worker group of an engine whose ranks an external launcher (torchrun, srun) started and watches."""

    @property
    def failures(self) -> dict[int, str]:
        return {}

    def terminate(self) -> None:
        pass

    def join(self, timeout: float) -> None:
        pass


@dataclass(frozen=True)
class WorkerStart:
    """What rank 0 tells the launcher when it starts the other ranks: the artifact, the backend and device kind it
    resolved (so that every rank computes alike), and whom to tell when a rank ends."""

    artifact: Path
    backend: str
    device_type: str
    on_exit: Callable[[int, str | None], None]


@dataclass(frozen=True)
class RankLaunch:
    """How the ranks of a parallel engine come to be (see the module docstring).

    `prepare_program(artifact, position)` returns the program of a rank
    position (a RankProgram of octavo.passes.rank_program) made from the loaded
    artifact; `start_workers(start)` starts the other ranks of the engine and
    returns them, calling `start.on_exit(rank, failure)` as each ends (failure
    None: cleanly).
    """

    rendezvous: Rendezvous
    prepare_program: Callable[[LoadedArtifact, RankPosition], object]
    start_workers: Callable[[WorkerStart], WorkerGroup]
