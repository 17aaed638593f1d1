"""Time the collectives of one tensor-parallel step: gloo all_reduce / all_gather between 2 local ranks.

    python benchmarks/all_reduce_step.py --hidden 576 --layers 30 --vocab 49152

Each rank uses one thread. For each token count T it times the all_reduce of a
float32 [1, T, hidden] tensor (one per o_proj and down_proj, and the
embedding: 2 * layers + 1 per step); for N sampled rows, the all_gather of
the [N, vocab / 2] logits shard, and the collectives of a decode step of N
sequences (T = N).
The minimum over repeats is reported (the machine is shared).
"""

from __future__ import annotations

import argparse
import datetime
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


def _rank(rank: int, port: int, hidden: int, layers: int, vocab: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    functional = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    reduce_s = {}
    for tokens in TOKENS:
        hidden_states = torch.randn(1, tokens, hidden)
        reduce_s[tokens] = _time(lambda x=hidden_states: functional.wait_tensor(functional.all_reduce(x, "sum", group)))
        if rank == 0:
            print(f"all_reduce [1, {tokens:3d}, {hidden}]: {reduce_s[tokens] * 1e3:.3f} ms; "
                  f"x {2 * layers + 1} per step = {(2 * layers + 1) * reduce_s[tokens] * 1e3:.1f} ms", flush=True)
    for rows in SAMPLED_ROWS:
        logits = torch.randn(rows, vocab // 2)
        gather_s = _time(lambda x=logits: functional.wait_tensor(functional.all_gather_into_tensor(x, 2, group)))
        if rank == 0:
            print(f"all_gather [{rows:3d}, {vocab // 2}] (logits of {rows} sampled rows): {gather_s * 1e3:.3f} ms; "
                  f"decode step of {rows} sequences: {((2 * layers + 1) * reduce_s[rows] + gather_s) * 1e3:.1f} ms "
                  "of collectives", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    mp.spawn(_rank, args=(args.port, args.hidden, args.layers, args.vocab), nprocs=2)


if __name__ == "__main__":
    main()
