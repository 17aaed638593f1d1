"""Benchmark workloads, read from benchmarks/workloads.toml."""

from __future__ import annotations

import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch

from octavo.errors import OctavoError

WORKLOADS_FILE = "workloads.toml"


@dataclass(frozen=True)
class Workload:
    """Requests of random token ids: `num_requests` prompts of `prompt_len_min..max` tokens
    (after a common `shared_prefix_len`-token prefix), each generating `output_len` tokens."""

    name: str
    description: str
    num_requests: int
    prompt_len_min: int
    prompt_len_max: int
    output_len: int
    seed: int = 0
    shared_prefix_len: int = 0

    def prompts(self, vocab_size: int, special_ids: set[int] = frozenset()) -> list[list[int]]:
        """The workload's prompts as token ids (deterministic for a given vocab)."""
        generator = torch.Generator().manual_seed(self.seed)
        allowed = torch.tensor([token for token in range(vocab_size) if token not in special_ids])

        def draw(count: int) -> list[int]:
            return allowed[torch.randint(len(allowed), (count,), generator=generator)].tolist()

        prefix = draw(self.shared_prefix_len)
        lengths = torch.randint(self.prompt_len_min, self.prompt_len_max + 1, (self.num_requests,),
                                generator=generator).tolist()
        return [prefix + draw(length) for length in lengths]


def workloads_path() -> Path:
    """benchmarks/workloads.toml of the source tree, else the copy installed under share/octavo."""
    candidates = [Path(__file__).resolve().parents[2] / "benchmarks" / WORKLOADS_FILE,
                  Path(sys.prefix) / "share" / "octavo" / "benchmarks" / WORKLOADS_FILE]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise OctavoError(f"cannot find {WORKLOADS_FILE}; looked in {', '.join(map(str, candidates))}")


def load_workloads() -> dict[str, Workload]:
    with open(workloads_path(), "rb") as handle:
        table = tomllib.load(handle)
    return {name: Workload(name=name, **fields) for name, fields in table.items()}


def get_workload(name: str) -> Workload:
    workloads = load_workloads()
    if name not in workloads:
        raise OctavoError(f"unknown workload {name!r}; choose one of {', '.join(sorted(workloads))}")
    return workloads[name]
