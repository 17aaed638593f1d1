"""Time octavo_cpu::linear_w8a8 against linear_bf16 and linear_w8 on SmolLM2's linear shapes.

    python scripts/measure_w8a8.py [--threads 2]

Hot: each (N, K) and row count alone, the weights in cache (best of 5 runs of a loop). Cold: one row through 30
layers' worth of the four shapes in turn (139 MB of int8 weights, as a decode step streams them). Prints times in
ms and the ratios to bfloat16 and w8; nothing is asserted (speed is for benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from octavo.codegen.cpu_backend.build import load_cpu_kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused qkv, o, fused gate_up, down


def best_time(run, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3


def int8_weight(n: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8),
            torch.rand(n, 1, generator=generator) * 0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_cpu_kernels()
    ops = torch.ops.octavo_cpu
    generator = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        q, scales = int8_weight(n, k, generator)
        packed, flat_scales, dense = ops.pack_w8a8(q), scales.reshape(-1).contiguous(), (q.float() * scales).bfloat16()
        for rows in (1, 64, 512):
            x = torch.randn(rows, k, generator=generator).bfloat16()
            repeats = 200 if rows == 1 else 20
            bf16 = best_time(partial(ops.linear_bf16, x, dense, None), repeats)
            w8 = best_time(partial(ops.linear_w8, x, q, scales, None, k, True), repeats)
            w8a8 = best_time(partial(ops.linear_w8a8, x, packed, flat_scales, None, n, k), repeats)
            print(f"hot  N={n} K={k} rows={rows}: bf16 {bf16:.3f}  w8 {w8:.3f}  w8a8 {w8a8:.3f} ms  "
                  f"w8a8/bf16 {w8a8 / bf16:.2f}  w8a8/w8 {w8a8 / w8:.2f}")
    xs = {k: torch.randn(1, k, generator=generator).bfloat16() for _, k in SHAPES}
    w8_calls, w8a8_calls, total = [], [], 0
    for _ in range(30):
        for n, k in SHAPES:
            q, scales = int8_weight(n, k, generator)
            w8_calls.append(partial(ops.linear_w8, xs[k], q, scales, None, k, True))
            w8a8_calls.append(partial(ops.linear_w8a8, xs[k], ops.pack_w8a8(q), scales.reshape(-1), None, n, k))
            total += n * k
    for name, calls in (("w8", w8_calls), ("w8a8", w8a8_calls)):
        elapsed = best_time(lambda calls=calls: [call() for call in calls], 10)
        print(f"cold one row, {total / 1e6:.0f} MB of weights: {name} {elapsed:.2f} ms = "
              f"{total / elapsed / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
