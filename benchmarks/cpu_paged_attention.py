"""Micro-benchmark of octavo_cpu::paged_attention decode on a SmolLM2-shaped paged pool.

64 decoding sequences with contexts 64..640 (spread evenly, blocks of 16 scattered over the pool),
9 query heads over 3 kv heads of 64 dims; reports the effective K/V read bandwidth of the op alone
(bytes of the visited K and V rows / time), the minimum over repeats (the machine may be shared).

    PYTHONPATH=$PWD python benchmarks/cpu_paged_attention.py --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from octavo.codegen.cpu_backend.build import load_cpu_kernels


def decode_batch(dtype: torch.dtype, sequences: int, heads: int, kv_heads: int, head_dim: int,
                 block_size: int, shortest: int, longest: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(shortest, longest, sequences).round().to(torch.int32)
    counts = [math.ceil(int(length) / block_size) for length in lengths]
    num_blocks = sum(counts) + 8
    pool = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    tables = torch.zeros(sequences, max(counts), dtype=torch.int32)
    used = 0
    for row, count in enumerate(counts):
        tables[row, :count] = pool[used:used + count]
        used += count
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = {name: torch.randn(shape, generator=generator).to(dtype) for name in ("key_cache", "value_cache")}
    # The query of a model of the cache's dtype: bf16/fp16 values (the op widens them to float itself).
    query = torch.randn(sequences, heads, head_dim, generator=generator).to(dtype)
    return dict(query=query,
                key=torch.randn(sequences, kv_heads, head_dim, generator=generator),
                value=torch.randn(sequences, kv_heads, head_dim, generator=generator), **caches,
                slot_mapping=torch.full((sequences,), -1, dtype=torch.int64), block_tables=tables,
                seq_lens=lengths, query_start_loc=torch.arange(sequences + 1, dtype=torch.int32),
                scale=1 / math.sqrt(head_dim))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--hot", action="store_true", help="every sequence reads the same blocks (cache-resident)")
    parser.add_argument("--layers", type=int, default=4, help="pools cycled through, so that L3 does not hold them")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    dtype = getattr(torch, args.dtype)
    batches = [decode_batch(dtype, 64, 9, 3, 64, 16, 64, 640, seed=layer) for layer in range(args.layers)]
    if args.hot:
        for batch in batches:
            batch["block_tables"] = torch.arange(batch["block_tables"].shape[1], dtype=torch.int32).expand_as(
                batch["block_tables"]).contiguous()
    visited = int(batches[0]["seq_lens"].sum()) * 3 * 64 * 2 * dtype.itemsize
    op = torch.ops.octavo_cpu.paged_attention
    for batch in batches:
        op(**batch)
    times, cpu_times = [], []
    for repeat in range(args.repeats):
        batch = batches[repeat % args.layers]
        start, cpu_start = time.perf_counter(), time.thread_time()
        op(**batch)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.thread_time() - cpu_start)
    best = min(times)
    print(f"{kernels.build_info} {args.dtype} cache, {args.threads} threads: {visited / 1e6:.1f} MB of K/V, "
          f"best {best * 1e3:.3f} ms, median {sorted(times)[len(times) // 2] * 1e3:.3f} ms, "
          f"{visited / best / 1e9:.1f} GB/s; CPU time of the calling thread: best {min(cpu_times) * 1e3:.3f} ms "
          f"(the whole op when it runs on one thread)")


if __name__ == "__main__":
    main()
