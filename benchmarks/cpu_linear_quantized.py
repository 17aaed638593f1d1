"""The quantized linears above the GEMV's rows: the kernels' own GEMM against oneDNN's, and both against linear_bf16.

    PYTHONPATH=. python benchmarks/cpu_linear_quantized.py [--threads 2] [--rows 16,64,512] [--rounds 5]

SmolLM2-135M's linear shapes (q/k/v, o, gate/up, down; 30 layers each with its own weights, so that a step reads
them from memory as a decode step does), the weights quantized as `--quant w8` (int8, one scale per output
channel) and `--quant w4` (groups of 32) store them. For every row count each linear is called through
`octavo_cpu::linear_w8` / `linear_w4` on bfloat16 rows with bf16_gemm on (what a model computing in bfloat16
runs), once with the CPU's own choice ("own": AMX tiles where the CPU has AMX-BF16, vdpbf16ps on other
AVX512_BF16 CPUs) and once with
OCTAVO_CPU_QUANTIZED_GEMM=onednn, and `octavo_cpu::linear_bf16` on bfloat16 weights of the same shape, in turn,
`--rounds` times over all layers. The table gives the median time per call and each kernel's whole-step sum
over the layers.

`--kernels` times only some of them: one kernel alone reads its own weights from memory, where in turn with
the others a kernel may find the weights the previous one just read in L3 (at one row, where the weights are
all the work, time one kernel at a time: `--rows 1 --kernels "w4 own"`).

On a shared machine read only the ratios, and run it with `taskset` on a fixed set of cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from octavo.codegen.cpu_backend.build import load_cpu_kernels
from octavo.ir.quantized_layout import num_groups, pack_int4

SHAPES = {"qkv": (576 + 2 * 192, 576), "o": (576, 576), "gate_up": (2 * 1536, 576), "down": (576, 1536)}
LAYERS = 30
W4_GROUP = 32
KERNELS = ("w8 own", "w8 onednn", "w4 own", "w4 onednn", "bf16")


def make_layer(rows: int, columns: int, generator: torch.Generator) -> dict:
    """One linear's weights in the three forms."""
    return {"w8": (torch.randint(-128, 128, (rows, columns), dtype=torch.int8, generator=generator),
                   torch.rand(rows, 1, generator=generator).half() * 0.01 + 1e-3),
            "w4": (pack_int4(torch.randint(0, 16, (rows, columns), dtype=torch.uint8, generator=generator)),
                   torch.rand(rows, num_groups(columns, W4_GROUP), generator=generator).half() * 0.01 + 1e-3,
                   torch.randn(rows, num_groups(columns, W4_GROUP), generator=generator).half() * 0.05),
            "bf16": (torch.randn(rows, columns, generator=generator) * 0.05).bfloat16()}


def call(kernel: str, x16: torch.Tensor, layer: dict) -> None:
    if kernel.startswith("w8"):
        qweight, scales = layer["w8"]
        torch.ops.octavo_cpu.linear_w8(x16, qweight, scales, None, qweight.shape[1], True)
    elif kernel.startswith("w4"):
        packed, scales, offsets = layer["w4"]
        torch.ops.octavo_cpu.linear_w4(x16, packed, scales, offsets, None, W4_GROUP, True)
    else:
        torch.ops.octavo_cpu.linear_bf16(x16, layer["bf16"])


def time_rows(layers: list[tuple[str, dict]], rows: int, rounds: int,
              kernels: tuple[str, ...] = KERNELS) -> dict[tuple[str, str], float]:
    """(shape, kernel) -> median seconds per call."""
    inputs = {columns: torch.randn(rows, columns).bfloat16() for columns in {576, 1536}}
    times: dict[tuple[str, str], list[float]] = {}
    for round_ in range(rounds):
        for index, (name, layer) in enumerate(layers):
            x16 = inputs[layer["bf16"].shape[1]]
            turn = (index + round_) % len(kernels)
            order = kernels[turn:] + kernels[:turn]
            for kernel in order:
                os.environ["OCTAVO_CPU_QUANTIZED_GEMM"] = "onednn" if kernel.endswith("onednn") else ""
                if round_ == 0:
                    call(kernel, x16, layer)  # packs the bf16 weight once, outside the timing
                start = time.perf_counter()
                call(kernel, x16, layer)
                times.setdefault((name, kernel), []).append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def report(rows: int, medians: dict[tuple[str, str], float], layers: int,
           kernels: tuple[str, ...] = KERNELS) -> None:
    print(f"\nrows = {rows}: median microseconds per call")
    print(f"  {'shape':<8}" + "".join(f"{kernel:>12}" for kernel in kernels))
    step = dict.fromkeys(kernels, 0.0)
    for name in SHAPES:
        print(f"  {name:<8}" + "".join(f"{medians[(name, kernel)] * 1e6:>12.1f}" for kernel in kernels))
        for kernel in kernels:
            step[kernel] += medians[(name, kernel)] * layers
    print(f"  {'step':<8}" + "".join(f"{step[kernel] * 1e6:>12.0f}" for kernel in kernels))
    if "bf16" in kernels and len(kernels) > 1:
        print("  against bf16: " + ", ".join(f"{kernel} {step[kernel] / step['bf16']:.2f}x"
                                           for kernel in kernels if kernel != "bf16"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="16,64,512")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help=f"comma-separated, of: {', '.join(KERNELS)} (default: all, in turn)")
    args = parser.parse_args()
    chosen = tuple(kernel.strip() for kernel in args.kernels.split(","))
    unknown = [kernel for kernel in chosen if kernel not in KERNELS]
    if unknown or not chosen:
        parser.error(f"unknown kernels {unknown}: choose from {', '.join(KERNELS)}")
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    print(f"CPU kernels: {kernels.target.describe()}, {kernels.build_info}; {args.threads} threads")
    generator = torch.Generator().manual_seed(0)
    layers = [(name, make_layer(*shape, generator)) for _ in range(args.layers) for name, shape in SHAPES.items()]
    with torch.inference_mode():
        for rows in (int(value) for value in args.rows.split(",")):
            report(rows, time_rows(layers, rows, args.rounds, chosen), args.layers, chosen)


if __name__ == "__main__":
    main()
