"""Time the collectives of one tensor-parallel step between 2 local ranks: shared memory against gloo.

    python benchmarks/all_reduce_step.py --hidden 576 --layers 30 --vocab 49152

Each rank uses one thread and calls the ops a compiled rank program calls
(octavo_rank::all_reduce / all_gather on the logical group "tp"), first bound
to gloo only, then also to the ranks' shared-memory group. For each token
count T it times the all_reduce of a float32 [1, T, hidden] tensor (one per
o_proj and down_proj, and the embedding: 2 * layers + 1 per step); for N
sampled rows, the all_gather of the [N, vocab / 2] logits shard, and the
collectives of a decode step of N sequences (T = N). The minimum over
repeats is reported.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS = (1, 8, 32, 128, 512)
SAMPLED_ROWS = (1, 8, 32, 128)
REPEATS = 50


def _time(operation, repeats: int = REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        operation()
        best = min(best, time.perf_counter() - start)
    return best


def _time_step(rank: int, label: str, hidden: int, layers: int, vocab: int) -> None:
    octavo_rank = torch.ops.octavo_rank
    reduce_s = {}
    for tokens in TOKENS:
        hidden_states = torch.randn(1, tokens, hidden)
        reduce_s[tokens] = _time(lambda x=hidden_states: octavo_rank.all_reduce(x, "tp"))
        if rank == 0:
            print(f"{label}: all_reduce [1, {tokens:3d}, {hidden}]: {reduce_s[tokens] * 1e3:.3f} ms; "
                  f"x {2 * layers + 1} per step = {(2 * layers + 1) * reduce_s[tokens] * 1e3:.2f} ms", flush=True)
    for rows in SAMPLED_ROWS:
        logits = torch.randn(rows, vocab // 2)
        gather_s = _time(lambda x=logits: octavo_rank.all_gather(x, "tp", 2, 1))
        if rank == 0:
            print(f"{label}: all_gather [{rows:3d}, {vocab // 2}] (logits of {rows} sampled rows): "
                  f"{gather_s * 1e3:.3f} ms; decode step of {rows} sequences: "
                  f"{((2 * layers + 1) * reduce_s[rows] + gather_s) * 1e3:.2f} ms of collectives", flush=True)


def _rank(rank: int, port: int, hidden: int, layers: int, vocab: int) -> None:
    from octavo.runtime.distributed.rank_collectives import bind_groups, unbind_groups
    from octavo.runtime.distributed.shm_groups import open_shared_memory_group

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    world = dist.group.WORLD
    bind_groups({"tp": world})
    _time_step(rank, "gloo", hidden, layers, vocab)
    shared = open_shared_memory_group(world, datetime.timedelta(seconds=60))
    if shared is None:
        raise SystemExit("the ranks could not open a shared-memory group here (see the log)")
    bind_groups({"tp": world}, {"tp": shared})
    _time_step(rank, "shm ", hidden, layers, vocab)
    unbind_groups()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    os.environ.setdefault("OCTAVO_SHM_COLLECTIVES", "auto")
    mp.spawn(_rank, args=(args.port, args.hidden, args.layers, args.vocab), nprocs=2)


if __name__ == "__main__":
    main()
