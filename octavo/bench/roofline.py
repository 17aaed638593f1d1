"""What the device gives, measured in the same run as the figures read against it.

Two ceilings (the method of the side-by-side harness, on the engine's own device):
copy bandwidth, a device-to-device copy of a buffer well past the caches,
counting bytes read plus bytes written; and the matrix rate, a square matrix
product in the given dtype, on random data (zeros run faster than real
data). Each is the median of several timed runs after warm-up runs, timed
with device events on a GPU and the wall clock on a CPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(run: Callable[[], object], device: torch.device, repeats: int = 10, warmup: int = 3) -> float:
    """Median wall time of `run()` on `device` (events on CUDA, perf_counter with a sync elsewhere)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            begin = time.perf_counter()
            run()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, num_bytes: int = 2**30) -> float:
    """Bytes per second of a device-to-device copy of `num_bytes`, counting the bytes read and written."""
    source = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    seconds = median_seconds(lambda: destination.copy_(source), device)
    return 2 * num_bytes / seconds


def matmul_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16, size: int = 8192) -> float:
    """Floating-point operations per second of a [size, size] x [size, size] product in `dtype`."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, dtype=dtype, device=device, generator=generator)
    b = torch.randn(size, size, dtype=dtype, device=device, generator=generator)
    out = torch.empty(size, size, dtype=dtype, device=device)
    seconds = median_seconds(lambda: torch.mm(a, b, out=out), device)
    return 2 * size**3 / seconds
