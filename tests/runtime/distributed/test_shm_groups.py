"""Shared-memory collectives between real rank processes on this host, against their definitions.

Each rank is its own process (gloo over a TCP store on 127.0.0.1, as the
engine's ranks are): all_reduce must equal the definition (every rank's input
summed in rank order; for 16-bit inputs in float32, rounded once), bit for
bit and on every rank, also where a tensor is larger than one exchange slot;
all_gather must equal the concatenation. A peer that dies must fail the wait
within seconds (also while it is an unreaped zombie), the ranks must agree to
stay on gloo when one of them opts out, and nothing may stay in /dev/shm.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import torch

from octavo.ir.ops.collectives import all_gather_reference, all_reduce_reference
from octavo.runtime.distributed.shm_groups import SHM_DIR, SLOT_BYTES

RANK_PROGRAM = """\
import datetime, json, os, sys, time
import torch
import torch.distributed as dist
from octavo.runtime.distributed.shm_groups import open_shared_memory_group

rank, world, port, scenario = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
group = open_shared_memory_group(dist.group.WORLD, datetime.timedelta(seconds=60))
result = {"shared": group is not None}
if scenario == "collectives":
    results = []
    for case, (shape, dtype) in enumerate(json.loads(os.environ["CASES"])):
        generator = torch.Generator().manual_seed(1000 * case + rank)
        x = torch.randn(shape, generator=generator).to(getattr(torch, dtype))
        results.append(group.all_reduce(x).float().flatten().tolist())
        results.append(group.all_gather(x, dim=len(shape) - 1).float().flatten().tolist())
    indices = torch.arange(5, dtype=torch.int64) + 10 * rank
    result["results"] = results
    result["gathered_ints"] = group.all_gather(indices.reshape(1, 5), dim=0).tolist()
elif scenario == "peer dies":
    group.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
        result["error"] = None
    except RuntimeError as error:
        result["error"] = str(error).splitlines()[0]
    result["seconds"] = time.monotonic() - start
print(json.dumps(result), flush=True)
os._exit(0)
"""

CASES = [([1, 576], "float32"), ([3, 5, 7], "float32"), ([2, 33], "bfloat16"), ([4, 9], "float16"),
         ([3, SLOT_BYTES // 4 // 3 + 1000], "float32"), ([2, SLOT_BYTES // 2 // 2 + 77], "bfloat16")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_ranks(world: int, scenario: str, env_of_rank=lambda rank: {}) -> list[subprocess.Popen]:
    port = _free_port()
    ranks = []
    for rank in range(world):
        env = {**os.environ, "CASES": json.dumps(CASES), **env_of_rank(rank)}
        ranks.append(subprocess.Popen([sys.executable, "-c", RANK_PROGRAM, str(rank), str(world), str(port), scenario],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    return ranks


def _result(process: subprocess.Popen) -> dict:
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def _regions() -> set[str]:
    return {path.name for path in SHM_DIR.glob("octavo-collectives-*")} if SHM_DIR.is_dir() else set()


def _inputs(case: int, world: int, shape: list[int], dtype: str) -> list[torch.Tensor]:
    return [torch.randn(shape, generator=torch.Generator().manual_seed(1000 * case + rank)).to(getattr(torch, dtype))
            for rank in range(world)]


def test_all_reduce_and_all_gather_equal_their_definitions_on_every_rank():
    world = 3
    before = _regions()
    # Three ranks on a 2-core machine oversubscribe it: force shared memory so that the test runs it.
    forced = {"OCTAVO_SHM_COLLECTIVES": "force"}
    results = [_result(rank) for rank in _start_ranks(world, "collectives", lambda rank: forced)]
    assert all(result["shared"] for result in results)
    for case, (shape, dtype) in enumerate(CASES):
        values = _inputs(case, world, shape, dtype)
        reduced = all_reduce_reference([value.float() for value in values]).to(getattr(torch, dtype))
        gathered = all_gather_reference(values, dim=len(shape) - 1)
        for result in results:
            all_reduced, all_gathered = result["results"][2 * case], result["results"][2 * case + 1]
            assert torch.equal(torch.tensor(all_reduced), reduced.float().flatten()), (shape, dtype)
            assert torch.equal(torch.tensor(all_gathered), gathered.float().flatten()), (shape, dtype)
    for result in results:
        assert result["gathered_ints"] == [[10 * rank + i for i in range(5)] for rank in range(world)]
    assert _regions() <= before


def test_a_peer_that_dies_fails_the_wait_within_seconds():
    rank0, rank1 = _start_ranks(2, "peer dies", lambda rank: {"OCTAVO_SHM_COLLECTIVES": "force"})
    # rank 1 stays an unreaped zombie until rank 0 has answered: a zombie must count as dead.
    result = _result(rank0)
    assert result["shared"]
    assert result["error"] is not None and "exited during a shared-memory collective" in result["error"]
    assert "pid" in result["error"] and result["seconds"] < 5
    rank1.wait(timeout=30)
    assert rank1.returncode == 3


def test_the_ranks_keep_gloo_together_when_one_opts_out():
    ranks = _start_ranks(2, "agreement only", lambda rank: {"OCTAVO_SHM_COLLECTIVES": "0"} if rank == 1 else {})
    assert [_result(rank)["shared"] for rank in ranks] == [False, False]

