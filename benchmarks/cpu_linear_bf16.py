"""octavo_cpu::linear_bf16 against oneDNN's bfloat16 linear on prepacked weights (what a compiled graph runs today).

    PYTHONPATH=. python benchmarks/cpu_linear_bf16.py [--threads 1] [--rows 1,2,4,8,16,64,512] [--rounds 5]
    PYTHONPATH=. python benchmarks/cpu_linear_bf16.py --threads 1 --rows 1 --rounds 3   # the decode check, ~10 s

SmolLM2-135M's linears, 30 layers of q/k/v, o, gate/up and down plus the lm_head, each with its own weights
(270 MB: a step reads them from memory, as a decode step does). For every row count, each linear is called
with both kernels one after the other, alternating which goes first, `--rounds` times over all layers; the
table gives the median time per call of each shape, the weight bytes read per second (memory-bound rows) or the
GEMM rate (compute-bound rows), the ratio ours / oneDNN's time, and the whole step's sum. oneDNN's weights are
packed as Inductor packs them for a graph compiled for every token count (mkldnn._reorder_linear_weight with the
example size 5 as the batch hint). Our kernel packs each weight at its first call (not timed).

On a shared machine, read only the ratios, and run it with `taskset` on a fixed set of cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from octavo.codegen.cpu_backend.build import load_cpu_kernels

SHAPES = {"qkv": (576 + 2 * 192, 576), "o": (576, 576), "gate_up": (2 * 1536, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)
LAYERS = 30
INDUCTOR_BATCH_HINT = 5


def make_linears(layers: int = LAYERS, seed: int = 0) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(shape name, bf16 weight, oneDNN-packed weight) for every linear of `layers` layers and the lm_head."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(name, shape) for _ in range(layers) for name, shape in SHAPES.items()] + [("lm_head", LM_HEAD)]
    linears = []
    for name, (rows, columns) in shapes:
        weight = (torch.randn(rows, columns, generator=generator) * 0.05).to(torch.bfloat16)
        linears.append((name, weight, torch.ops.mkldnn._reorder_linear_weight(weight, INDUCTOR_BATCH_HINT)))
    return linears


def time_rows(linears, rows: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Shape name -> (median seconds per call of oneDNN, of ours)."""
    inputs = {columns: torch.randn(rows, columns).to(torch.bfloat16) for columns in {576, 1536}}
    for _, weight, _ in linears:  # packs every weight once, outside the timing
        torch.ops.octavo_cpu.linear_bf16(inputs[weight.shape[1]], weight)
    times: dict[tuple[str, int], list[float]] = {}
    for round_ in range(rounds):
        for index, (name, weight, packed) in enumerate(linears):
            x = inputs[weight.shape[1]]
            for which in ((0, 1) if (index + round_) % 2 == 0 else (1, 0)):
                start = time.perf_counter()
                if which == 0:
                    torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                else:
                    torch.ops.octavo_cpu.linear_bf16(x, weight)
                times.setdefault((name, which), []).append(time.perf_counter() - start)
    return {name: (statistics.median(times[(name, 0)]), statistics.median(times[(name, 1)]))
            for name in [*SHAPES, "lm_head"]}


def report(rows: int, medians: dict[str, tuple[float, float]], layers: int) -> None:
    compute_bound = rows > 8
    unit = "GFLOP/s" if compute_bound else "GB/s"
    print(f"\nrows = {rows}: median time per call, the weight bytes read per second (GEMV) or the GEMM rate")
    print(f"  {'shape':<8}{'N x K':>12}{'oneDNN us':>11}{'ours us':>10}{'oneDNN ' + unit:>15}{'ours ' + unit:>13}"
          f"{'ours/oneDNN':>13}")
    step = [0.0, 0.0]
    for name, (onednn, ours) in medians.items():
        rows_w, columns = SHAPES.get(name, LM_HEAD)
        count = 1 if name == "lm_head" else layers
        step[0] += onednn * count
        step[1] += ours * count
        work = 2 * rows * rows_w * columns if compute_bound else 2 * rows_w * columns
        scale = 1e9
        print(f"  {name:<8}{f'{rows_w} x {columns}':>12}{onednn * 1e6:>11.1f}{ours * 1e6:>10.1f}"
              f"{work / onednn / scale:>15.1f}{work / ours / scale:>13.1f}{ours / onednn:>13.3f}")
    print(f"  {'step':<8}{f'{layers} layers':>12}{step[0] * 1e6:>11.0f}{step[1] * 1e6:>10.0f}{'':>28}"
          f"{step[1] / step[0]:>13.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8,16,64,512")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=LAYERS, help="layers of linears (fewer fit in cache)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    print(f"CPU kernels: {kernels.target.describe()}, {kernels.build_info}; {args.threads} threads")
    linears = make_linears(args.layers)
    with torch.inference_mode():
        for rows in (int(value) for value in args.rows.split(",")):
            report(rows, time_rows(linears, rows, args.rounds), args.layers)


if __name__ == "__main__":
    main()
