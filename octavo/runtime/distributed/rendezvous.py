"""Where the ranks of a parallel engine meet, as the launcher that started them tells it.

Three kinds of launcher start ranks:

- an external one that starts every rank itself: torchrun (and the Kubernetes
  operators that set the same variables) writes ``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``;
  SLURM's srun writes ``SLURM_PROCID``, ``SLURM_LOCALID``,
  ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_NODEID``
  and the step's node list, from which the first node's name is the address
  (``MASTER_ADDR`` / ``MASTER_PORT`` win where they are set);
- Octavo's own launcher (``octavo serve -tp 2``, ``LLM(tensor_parallel_size=2)``),
  which starts the worker ranks of its node as processes and gives each the
  same variables torchrun would;
- Ray, whose actors get the same variables from the engine that places them.

Every rank then meets the others through the same code: a TCP store at
MASTER_ADDR:MASTER_PORT (hosted by rank 0, or by torchelastic's agent when
it says so with ``TORCHELASTIC_USE_AGENT_STORE``), as
``init_process_group(init_method="env://")`` would.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from octavo.errors import OctavoError

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_BASE_PORT = 29500
"""srun without MASTER_PORT: the port is SLURM_BASE_PORT + (job id mod 10000), the same on every node of the job."""


@dataclass(frozen=True)
class Rendezvous:
    """One process's place among the ranks: its rank, its node's share, and the address every rank meets at."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "octavo", "torchrun", "srun" or "ray"
    agent_store: bool = False  # torchelastic's agent hosts the store: rank 0 connects to it like the others
    run_id: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise OctavoError(f"{self.launcher}: rank {self.rank} is outside a world of {self.world_size} ranks")
        if not 0 <= self.local_rank < self.local_world_size:
            raise OctavoError(f"{self.launcher}: local rank {self.local_rank} is outside this node's "
                              f"{self.local_world_size} ranks")
        if not 0 < self.master_port < 2**16:
            raise OctavoError(f"{self.launcher}: rendezvous port {self.master_port} is not a TCP port (1..65535)")

    @property
    def endpoint(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    @property
    def store_prefix(self) -> str:
        """Octavo's keys in the store: apart per launch, since torchelastic's agent store outlives a restart."""
        return f"octavo/{self.run_id}/" if self.run_id else "octavo/"

    def for_rank(self, rank: int, local_rank: int, launcher: str | None = None) -> Rendezvous:
        """The rendezvous of another rank of the same launch (what a launcher hands the ranks it starts)."""
        return Rendezvous(rank, self.world_size, local_rank, self.local_world_size, self.master_addr,
                          self.master_port, launcher or self.launcher, self.agent_store, self.run_id)

    def environment(self) -> dict[str, str]:
        """The variables torchrun would set for this rank (what Octavo's launcher and Ray actors are given)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port), "OCTAVO_LAUNCHER": self.launcher,
                "OCTAVO_RUN_ID": self.run_id}


def launched_rendezvous(environ: Mapping[str, str] | None = None) -> Rendezvous | None:
    """The rendezvous a launcher wrote into the environment, or None when no launcher started this process.

    torchrun's variables win over SLURM's (torchrun inside an srun step starts
    the ranks); SLURM's count only in a step of more than one task, so that a
    batch script that runs one `octavo serve` is not taken for a rank.
    Partial or malformed variables raise an OctavoError naming them.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return _torchrun(environ)
    if environ.get("SLURM_PROCID") is not None and _int(environ, "SLURM_STEP_NUM_TASKS", default=1) > 1:
        return _srun(environ)
    return None


def _torchrun(environ: Mapping[str, str]) -> Rendezvous:
    missing = [name for name in TORCHRUN_VARIABLES if not environ.get(name)]
    if missing:
        present = ", ".join(f"{name}={environ[name]}" for name in (*TORCHRUN_VARIABLES, "LOCAL_RANK")
                            if environ.get(name))
        raise OctavoError(f"launched as a rank ({present}) but {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not set: a launcher such as torchrun sets "
                          f"{', '.join(TORCHRUN_VARIABLES)} for every rank")
    world_size = _int(environ, "WORLD_SIZE")
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE", default=world_size)
    return Rendezvous(
        rank=_int(environ, "RANK"), world_size=world_size,
        local_rank=_int(environ, "LOCAL_RANK", default=_int(environ, "RANK") % local_world_size),
        local_world_size=local_world_size, master_addr=environ["MASTER_ADDR"],
        master_port=_int(environ, "MASTER_PORT"),
        launcher=environ.get("OCTAVO_LAUNCHER") or ("torchrun" if "TORCHELASTIC_RUN_ID" in environ else "env"),
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        run_id=environ.get("OCTAVO_RUN_ID") or _torchelastic_run_id(environ))


def _torchelastic_run_id(environ: Mapping[str, str]) -> str:
    if "TORCHELASTIC_RUN_ID" not in environ:
        return ""
    return f"{environ['TORCHELASTIC_RUN_ID']}-{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _srun(environ: Mapping[str, str]) -> Rendezvous:
    world_size = _int(environ, "SLURM_STEP_NUM_TASKS")
    node_id = _int(environ, "SLURM_NODEID", default=0)
    tasks_per_node = tasks_per_node_list(environ.get("SLURM_STEP_TASKS_PER_NODE") or str(world_size))
    if node_id >= len(tasks_per_node):
        raise OctavoError(f"srun: SLURM_NODEID={node_id} but SLURM_STEP_TASKS_PER_NODE lists "
                          f"{len(tasks_per_node)} node(s)")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    master_addr = environ.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else None)
    if not master_addr:
        raise OctavoError("srun: neither MASTER_ADDR nor SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is set, so the "
                          "ranks have no address to meet at")
    if environ.get("MASTER_PORT"):
        port = _int(environ, "MASTER_PORT")
    elif environ.get("SLURM_JOB_ID", "").isdigit():
        port = SLURM_BASE_PORT + int(environ["SLURM_JOB_ID"]) % 10000
    else:
        raise OctavoError("srun: neither MASTER_PORT nor SLURM_JOB_ID is set, so the ranks have no port to meet at")
    return Rendezvous(rank=_int(environ, "SLURM_PROCID"), world_size=world_size,
                      local_rank=_int(environ, "SLURM_LOCALID", default=0),
                      local_world_size=tasks_per_node[node_id], master_addr=master_addr, master_port=port,
                      launcher="srun", run_id=f"slurm-{environ.get('SLURM_JOB_ID', '')}."
                                              f"{environ.get('SLURM_STEP_ID', '')}")


def first_host(nodelist: str) -> str:
    """The first host name of a SLURM host list: "gpu[07-09,12],cpu1" -> "gpu07"."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if match is None or not (match.group(1) or match.group(2)):
        raise OctavoError(f"srun: cannot read a host name from the node list {nodelist!r}")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix + suffix
    return prefix + re.split(r"[-,]", ranges)[0] + suffix


def tasks_per_node_list(value: str) -> list[int]:
    """SLURM's compressed tasks-per-node list: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise OctavoError(f"srun: cannot read the tasks per node {value!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None or value == "":
        if default is None:
            raise OctavoError(f"the launcher variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise OctavoError(f"the launcher variable {name}={value!r} is not an integer") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (bound and released; the rendezvous binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
