"""Micro-benchmarks of the native CPU kernels against the torch backend, at SmolLM2-135M's shapes.

    python benchmarks/cpu_kernels.py [--threads 2] [--repeats 20]

- prefill attention: a 512-token prompt, and a 128-token chunk after 384 cached tokens;
- decode attention (one query token per sequence, contexts spread over 64-640 tokens, fp32 and
  bf16 caches, 9 query / 3 kv heads of 64 dims, 16-token blocks) at batch 1 and 64, plus the same
  batch-64 step where every sequence shares a 512-token prefix (cascade);
- linear_w16 (bf16 weights, fp32 compute) at m=1 and m=64 against torch's fp32 linear, for the
  q/k/v+o, gate/up, down and lm_head shapes, with the weight bytes read per second.

Times are the minimum over the repeats (other processes share the CPU: read them as direction,
and against `../shared/bench/roofline.py`'s read bandwidth in the same sitting).
"""

from __future__ import annotations

import argparse
import time

import torch

from octavo.codegen.cpu_backend.build import load_cpu_kernels
from octavo.codegen.torch_backend.attention import paged_attention as torch_paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LINEARS = {"qkv": (576 + 2 * 192, 576), "o": (576, 576), "gate_up": (2 * 1536, 576), "down": (576, 1536),
           "lm_head": (49152, 576)}


def best_time(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_batch(batch: int, dtype: torch.dtype, shared_prefix: int = 0, seed: int = 0):
    """One decode step's paged_attention arguments: contexts 64-640 tokens, blocks scattered over the pool."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(64, 640, batch).long() if batch > 1 else torch.tensor([640])
    if shared_prefix:
        lengths = lengths.clamp(min=shared_prefix + 1)
    blocks_per_seq = [-(-int(length) // BLOCK) for length in lengths]
    shared_blocks = shared_prefix // BLOCK
    num_blocks = sum(count - shared_blocks for count in blocks_per_seq) + shared_blocks + 1
    pool = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    tables = torch.zeros(batch, max(blocks_per_seq), dtype=torch.int32)
    used = shared_blocks
    for row, count in enumerate(blocks_per_seq):
        tables[row, :shared_blocks] = pool[:shared_blocks]
        tables[row, shared_blocks:count] = pool[used:used + count - shared_blocks]
        used += count - shared_blocks
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    positions = lengths - 1
    slots = tables.long().gather(1, (positions // BLOCK).view(-1, 1)).flatten() * BLOCK + positions % BLOCK
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=generator).to(dtype)
    key = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    value = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    args = (query, key, value, key_cache, value_cache, slots, tables, lengths.to(torch.int32), starts,
            HEAD_DIM ** -0.5, -1)
    kv_bytes = int(lengths.sum()) * KV_HEADS * HEAD_DIM * 2 * key_cache.element_size()
    return args, kv_bytes


def bench_attention(repeats: int) -> None:
    print("decode attention, 9/3 heads x 64 dims, contexts 64-640 (ms per layer call; KV GB/s read by the kernel)")
    print(f"{'case':<34}{'torch':>10}{'cpu':>10}{'speedup':>9}{'GB/s':>8}")
    for batch, shared in ((1, 0), (64, 0), (64, 512)):
        for dtype in (torch.float32, torch.bfloat16):
            args, kv_bytes = decode_batch(batch, dtype, shared)
            reference = best_time(lambda args=args: torch_paged_attention(*args), repeats)
            native = best_time(lambda args=args: torch.ops.octavo_cpu.paged_attention(*args), repeats)
            label = f"B={batch} {str(dtype)[6:]}" + (f" shared {shared}" if shared else "")
            print(f"{label:<34}{reference * 1e3:>10.3f}{native * 1e3:>10.3f}{reference / native:>8.2f}x"
                  f"{kv_bytes / native / 1e9:>8.1f}")


def prefill_batch(prompt: int, cached: int = 0, seed: int = 0):
    """One sequence's prefill (or a chunk of `prompt` tokens after `cached` ones) in fp32."""
    generator = torch.Generator().manual_seed(seed)
    length = cached + prompt
    num_blocks = -(-length // BLOCK) + 1
    tables = torch.randperm(num_blocks, generator=generator)[:num_blocks - 1].to(torch.int32).view(1, -1)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    positions = torch.arange(cached, length)
    slots = tables[0].long()[positions // BLOCK] * BLOCK + positions % BLOCK
    query = torch.randn(prompt, HEADS, HEAD_DIM, generator=generator)
    key = torch.randn(prompt, KV_HEADS, HEAD_DIM, generator=generator)
    value = torch.randn(prompt, KV_HEADS, HEAD_DIM, generator=generator)
    return (query, key, value, key_cache, value_cache, slots, tables, torch.tensor([length], dtype=torch.int32),
            torch.tensor([0, prompt], dtype=torch.int32), HEAD_DIM ** -0.5, -1)


def bench_prefill(repeats: int) -> None:
    print("prefill attention, fp32, one sequence (ms per layer call)")
    print(f"{'case':<34}{'torch':>10}{'cpu':>10}{'speedup':>9}")
    for prompt, cached in ((512, 0), (128, 384)):
        args = prefill_batch(prompt, cached)
        reference = best_time(lambda args=args: torch_paged_attention(*args), repeats)
        native = best_time(lambda args=args: torch.ops.octavo_cpu.paged_attention(*args), repeats)
        label = f"{prompt} new tokens" + (f" after {cached} cached" if cached else "")
        print(f"{label:<34}{reference * 1e3:>10.3f}{native * 1e3:>10.3f}{reference / native:>8.2f}x")


def bench_linear(repeats: int) -> None:
    print("linear: torch fp32 vs octavo_cpu.linear_w16 (bf16 weights), ms; weight GB/s")
    print(f"{'shape':<22}{'m':>4}{'fp32':>10}{'GB/s':>7}{'w16':>10}{'GB/s':>7}{'speedup':>9}")
    for name, (rows, columns) in LINEARS.items():
        weight = torch.randn(rows, columns) * 0.05
        narrow = weight.to(torch.bfloat16)
        for m in (1, 64):
            x = torch.randn(m, columns)
            fp32 = best_time(lambda x=x, weight=weight: torch.nn.functional.linear(x, weight), repeats)
            w16 = best_time(lambda x=x, narrow=narrow: torch.ops.octavo_cpu.linear_w16(x, narrow), repeats)
            print(f"{name + f' {rows}x{columns}':<22}{m:>4}{fp32 * 1e3:>10.3f}{weight.numel() * 4 / fp32 / 1e9:>7.1f}"
                  f"{w16 * 1e3:>10.3f}{narrow.numel() * 2 / w16 / 1e9:>7.1f}{fp32 / w16:>8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", choices=["attention", "linear"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    print(f"CPU kernels: {kernels.target.describe()}, {kernels.build_info}; {args.threads} threads")
    with torch.inference_mode():
        if args.only != "linear":
            bench_attention(args.repeats)
            bench_prefill(args.repeats)
        if args.only != "attention":
            bench_linear(args.repeats)


if __name__ == "__main__":
    main()
