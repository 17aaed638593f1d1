"""GPTQ's solver on one SmolLM2-135M layer's linears: seconds per layer, with and without act-order.

    PYTHONPATH=. python benchmarks/gptq_solver.py [--threads 2] [--rounds 3] [--group-size 64]

The shapes are what `--quant w4-gptq` solves per layer (q, k, v, o, gate, up, down); each weight is random and
each Hessian is 2 X^T X / n of 4608 random inputs with channels of unequal size (as 9 calibration runs of 512
tokens give it). Prints the median over `--rounds` of the whole layer's solve. A SmolLM2 compile solves 30 such
layers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from octavo.passes.gptq_solver import gptq_quantize

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
CALIBRATION_ROWS = 4608


def layer_problems(generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    problems = []
    for rows, columns in LAYER:
        inputs = torch.randn(CALIBRATION_ROWS, columns, generator=generator) * (
            torch.rand(columns, generator=generator) * 3 + 0.1)
        weight = torch.randn(rows, columns, generator=generator) * 0.05
        problems.append((weight, 2 * inputs.T @ inputs / CALIBRATION_ROWS))
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    problems = layer_problems(torch.Generator().manual_seed(0))
    for act_order in (False, True):
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for weight, hessian in problems:
                gptq_quantize(weight, hessian, args.group_size, act_order=act_order)
            times.append(time.perf_counter() - start)
        print(f"act_order={act_order}: {statistics.median(times):.3f} s per layer "
              f"({args.threads} threads, group {args.group_size})")


if __name__ == "__main__":
    main()
