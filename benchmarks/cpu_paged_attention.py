"""Micro-benchmark of octavo_cpu::paged_attention on a SmolLM2-shaped paged pool.

9 query heads over 3 kv heads of 64 dims, blocks of 16 scattered over the pool; the minimum over
repeats is what counts (the machine may be shared).

- ``--mode decode``: 64 decoding sequences with contexts 64..640 (spread evenly); reports the
  effective K/V read bandwidth of the op alone (bytes of the visited K and V rows / time).
  ``--cache-dtype int8|fp8`` quantizes the pools (a float32 scale per row) to measure those cache paths.
- ``--mode prefill``: one prefill step of ``--sequences`` whole prompts of 67..508 tokens (spread
  evenly, as in the throughput workload); reports GFLOP/s of the causal attention (4 * head_dim
  flops per visible (query, key) pair and query head: q . k and p * v).

    PYTHONPATH=$PWD python benchmarks/cpu_paged_attention.py --dtype bfloat16 --threads 2
    PYTHONPATH=$PWD python benchmarks/cpu_paged_attention.py --mode prefill --threads 1
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


def prefill_batch(dtype: torch.dtype, sequences: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                  shortest: int, longest: int, seed: int = 0) -> dict:
    """One step of whole prompts: every query token of each sequence is new, its K/V written by the call."""
    batch = decode_batch(dtype, sequences, heads, kv_heads, head_dim, block_size, shortest, longest, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    lengths = batch["seq_lens"].long()
    tokens = int(lengths.sum())
    tables, size = batch["block_tables"].long(), block_size
    slots = torch.cat([tables[row, torch.arange(int(length)) // size] * size + torch.arange(int(length)) % size
                       for row, length in enumerate(lengths)])
    starts = torch.zeros(sequences + 1, dtype=torch.int32)
    starts[1:] = lengths.cumsum(0)
    batch.update(query=torch.randn(tokens, heads, head_dim, generator=generator).to(dtype),
                 key=torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype),
                 value=torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype),
                 slot_mapping=slots, query_start_loc=starts)
    return batch


def quantize_pools(batch: dict, dtype: torch.dtype) -> None:
    """Replace the float pools by ``dtype`` ones with a float32 scale per (block, token, kv head) row."""
    for name in ("key_cache", "value_cache"):
        pool = batch[name].float()
        top = 127.0 if dtype == torch.int8 else 448.0
        scales = pool.abs().amax(-1).clamp_min(1e-6) / top
        values = pool / scales.unsqueeze(-1)
        batch[name] = values.round().to(dtype) if dtype == torch.int8 else values.to(dtype)
        batch[name.replace("_cache", "_scale_cache")] = scales


def prefill_flops(batch: dict) -> int:
    heads, head_dim = batch["query"].shape[1:]
    pairs = sum(int(length) * (int(length) + 1) // 2 for length in batch["seq_lens"])
    return 4 * head_dim * heads * pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--mode", default="decode", choices=["decode", "prefill"])
    parser.add_argument("--sequences", type=int, default=8, help="prompts in the prefill step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--hot", action="store_true", help="every sequence reads the same blocks (cache-resident)")
    parser.add_argument("--layers", type=int, default=4, help="pools cycled through, so that L3 does not hold them")
    parser.add_argument("--cache-dtype", default="same", choices=["same", "int8", "fp8"],
                        help="decode: the K/V pools in --dtype (same) or quantized with a float32 scale per row")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    dtype = getattr(torch, args.dtype)
    if args.mode == "prefill":
        return run_prefill(args, kernels.build_info, dtype)
    batches = [decode_batch(dtype, 64, 9, 3, 64, 16, 64, 640, seed=layer) for layer in range(args.layers)]
    if args.hot:
        for batch in batches:
            batch["block_tables"] = torch.arange(batch["block_tables"].shape[1], dtype=torch.int32).expand_as(
                batch["block_tables"]).contiguous()
    row_bytes = 64 * dtype.itemsize
    if args.cache_dtype != "same":
        for batch in batches:
            quantize_pools(batch, torch.int8 if args.cache_dtype == "int8" else torch.float8_e4m3fn)
        row_bytes = 64 + 4
    visited = int(batches[0]["seq_lens"].sum()) * 3 * 2 * row_bytes
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
    cache = args.dtype if args.cache_dtype == "same" else args.cache_dtype
    print(f"{kernels.build_info} {cache} cache, {args.threads} threads: {visited / 1e6:.1f} MB of K/V, "
          f"best {best * 1e3:.3f} ms, median {sorted(times)[len(times) // 2] * 1e3:.3f} ms, "
          f"{visited / best / 1e9:.1f} GB/s; CPU time of the calling thread: best {min(cpu_times) * 1e3:.3f} ms "
          f"(the whole op when it runs on one thread)")


def run_prefill(args: argparse.Namespace, build_info: str, dtype: torch.dtype) -> None:
    batch = prefill_batch(dtype, args.sequences, 9, 3, 64, 16, 67, 508)
    flops = prefill_flops(batch)
    op = torch.ops.octavo_cpu.paged_attention
    op(**batch)
    times, cpu_times = [], []
    for _ in range(args.repeats):
        start, cpu_start = time.perf_counter(), time.thread_time()
        op(**batch)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.thread_time() - cpu_start)
    best, cpu_best = min(times), min(cpu_times)
    print(f"{build_info} {args.dtype} prefill of {args.sequences} prompts ({int(batch['seq_lens'].sum())} tokens), "
          f"{args.threads} threads: best {best * 1e3:.3f} ms, median {sorted(times)[len(times) // 2] * 1e3:.3f} ms, "
          f"{flops / best / 1e9:.1f} GFLOP/s; CPU time of the calling thread: best {cpu_best * 1e3:.3f} ms, "
          f"{flops / cpu_best / 1e9:.1f} GFLOP/s (the whole op when it runs on one thread)")


if __name__ == "__main__":
    main()
