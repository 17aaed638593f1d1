"""One worker rank of a parallel engine in this process: what it is told (WorkerSpec), and running it."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from octavo.config import EngineConfig
from octavo.runtime.distributed.devices import rank_device
from octavo.runtime.distributed.rendezvous import Rendezvous
from octavo.runtime.distributed.topology import Topology
from octavo.runtime.distributed.worker import WorkerOptions, run_worker


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker rank is told besides its rendezvous (sent as JSON on its command line)."""

    artifact: str
    config: dict
    backend: str
    device: str  # the device kind rank 0 runs on: cpu or cuda
    verify: bool = False
    log_level: int = logging.WARNING

    @classmethod
    def of(cls, artifact: Path, config: EngineConfig, backend: str, device: str, verify: bool) -> WorkerSpec:
        options = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)
                   if field.name not in ("speculative", "extra")}  # workers verify, they do not speculate
        return cls(str(artifact), options, backend, device, verify,
                   logging.getLogger("octavo").getEffectiveLevel())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.config)


def run_rank(artifact: str | Path, config: EngineConfig, rendezvous: Rendezvous, backend: str, device_kind: str,
             verify: bool) -> None:
    """Run rank `rendezvous.rank` of the engine in this process until the engine shuts down."""
    from octavo.parallel.programs import load_program

    position = Topology.of(config).position(rendezvous.rank)
    device = rank_device(device_kind, rendezvous.local_rank, rendezvous.local_world_size)
    root = Path(artifact).expanduser().resolve()
    run_worker(rendezvous, WorkerOptions(config, backend, device), lambda: load_program(root, position, verify))
