"""Shared-memory collectives for the tensor-parallel ranks of one host (the octavo_cpu::shm_* ops).

gloo moves a decode step's all_reduce ([tokens, hidden], a few hundred KB at
most) over loopback TCP in ~0.17 ms, nearly all of it latency; a 30-layer
model makes 61 of them per step. Ranks on one host instead exchange through
one mapped file in /dev/shm (see csrc/shm_collectives.cpp), in microseconds.

It is used for a group only when every one of its ranks agrees that it can:
all on the same host (hostname and boot id), the CPU kernels loaded, a
/dev/shm to map, every peer's process visible, and the cores not
oversubscribed (ranks on the host x threads per rank <= the CPUs this
process may run on): a waiting rank spins, which only pays when each rank
owns its cores. Otherwise, or with OCTAVO_SHM_COLLECTIVES=0, the group keeps
gloo; OCTAVO_SHM_COLLECTIVES=force uses shared memory even on oversubscribed
cores (a waiting rank sleeps after a few milliseconds of spinning).
Agreement goes through gloo on the group itself, so every rank decides
alike. The region's name is unlinked as soon as every rank has mapped it, at
start-up: from then on nothing is left in /dev/shm, whatever way the ranks
end (a crash within that exchange can leave the file).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from octavo.codegen.cpu_backend.build import CpuKernelsUnavailableError, load_cpu_kernels

logger = logging.getLogger(__name__)

SHM_ENV = "OCTAVO_SHM_COLLECTIVES"
SLOT_BYTES = 1 << 20
"""Bytes one rank moves per exchange; larger collectives go in chunks. The region is 2 x world x this."""
SHM_DIR = Path("/dev/shm")
REDUCIBLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SharedMemoryGroup:
    """An open shared-memory group: the handle of the octavo_cpu::shm_* ops and the group's size."""

    handle: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, summed in float32 in rank order and rounded once (same on every rank)."""
        return torch.ops.octavo_cpu.shm_all_reduce(x, self.handle)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `x` joined along `dim`, in rank order."""
        stacked = torch.ops.octavo_cpu.shm_all_gather(x, self.handle)
        return torch.cat(stacked.unbind(0), dim=dim)

    def close(self) -> None:
        torch.ops.octavo_cpu.shm_group_close(self.handle)


def open_shared_memory_group(group: dist.ProcessGroup, timeout: datetime.timedelta) -> SharedMemoryGroup | None:
    """A shared-memory group over the ranks of `group` (a collective call on it), or None to keep gloo.

    Every rank of `group` gets the same answer. `timeout` bounds each wait in a collective.
    """
    world = dist.get_world_size(group)
    if world == 1 or dist.get_backend(group) != "gloo":
        return None
    local = _local_facts()
    facts: list = [None] * world
    dist.all_gather_object(facts, local, group=group)
    reason = _reason_to_keep_gloo(facts)
    if reason is not None:
        logger.info("tensor-parallel collectives stay on gloo: %s", reason)
        return None
    rank = dist.get_rank(group)
    path = str(SHM_DIR / f"octavo-collectives-{uuid.uuid4().hex}") if rank == 0 else None
    handle = _open(path, rank, world, timeout, create=True) if rank == 0 else None
    announced = [path if handle is not None else None]
    dist.broadcast_object_list(announced, group_src=0, group=group)
    if announced[0] is None:
        return None
    if rank != 0:
        handle = _open(announced[0], rank, world, timeout, create=False)
    opened: list = [None] * world
    dist.all_gather_object(opened, handle is not None, group=group)
    if rank == 0:
        Path(announced[0]).unlink(missing_ok=True)
    alive = handle is not None and all(opened) and torch.ops.octavo_cpu.shm_group_peers_alive(handle)
    agreed: list = [None] * world
    dist.all_gather_object(agreed, alive, group=group)
    if not all(agreed):
        if handle is not None:
            torch.ops.octavo_cpu.shm_group_close(handle)
        logger.info("tensor-parallel collectives stay on gloo: a rank could not map the shared region")
        return None
    logger.info("tensor-parallel collectives of %d ranks go through shared memory", world)
    return SharedMemoryGroup(handle, world)


def _local_facts() -> dict:
    """What this rank knows about itself, for the group to agree on."""
    setting = os.environ.get(SHM_ENV, "auto").strip().lower()
    enabled = setting not in ("0", "false", "no", "off")
    return {"host": socket.gethostname(), "boot": _boot_id(), "enabled": enabled, "forced": setting == "force",
            "kernels": _kernels_loaded(), "shm": SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK),
            "threads": torch.get_num_threads(), "cpus": len(os.sched_getaffinity(0))}


def _reason_to_keep_gloo(facts: list[dict]) -> str | None:
    if not all(fact["enabled"] for fact in facts):
        return f"{SHM_ENV}=0"
    if len({(fact["host"], fact["boot"]) for fact in facts}) != 1:
        return "the ranks are on more than one host"
    if not all(fact["kernels"] for fact in facts):
        return "the CPU kernels are not loaded on every rank"
    if not all(fact["shm"] for fact in facts):
        return f"{SHM_DIR} is not writable on every rank"
    wanted = sum(fact["threads"] for fact in facts)
    cpus = min(fact["cpus"] for fact in facts)
    if wanted > cpus and not all(fact["forced"] for fact in facts):
        return f"{len(facts)} ranks want {wanted} threads on {cpus} CPUs (waiting ranks would spin on shared cores)"
    return None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _kernels_loaded() -> bool:
    try:
        load_cpu_kernels()
    except CpuKernelsUnavailableError:
        return False
    return True


def _open(path: str, rank: int, world: int, timeout: datetime.timedelta, create: bool) -> int | None:
    try:
        return torch.ops.octavo_cpu.shm_group_open(path, rank, world, SLOT_BYTES, timeout.total_seconds(), create)
    except RuntimeError as error:
        logger.info("rank %d could not map %s: %s", rank, path, str(error).splitlines()[0])
        return None
