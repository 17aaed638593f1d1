"""GPU check step: one model shape end to end, correctness first, then its speed figures with their ratios.

``python scripts/gpu_model_check.py SHAPE`` on the bf16 artifact of gpu_prepare.py (triton backend, decode
steps as CUDA graphs, the engine's warm-up done at start):

- teacher forcing against HF bf16 on the same weights (gpu_hf.py): Octavo's logits within BF16_RELATIVE of
  HF's at every generated position, and every token HF's argmax or within BF16_TIE_MARGIN of its top
  logit and in its top 5;
- batch-1 decode: the `single` workload's inter-token latency, against the bandwidth ceiling (the bytes of
  the weights a step reads over the measured copy bandwidth);
- a 64-sequence decode step, against what its weight and KV bytes cost at copy bandwidth;
- TTFT of a 2048-token prompt, against the GEMM-bound limit (2 x layer parameters x tokens + the lm_head
  row, over the measured bf16 matmul rate);
- the `throughput` workload (64 requests; 256 for the 8B shape) as output tok/s, run twice for the small
  shape (the first run against the second), with the Triton kernels compiled during the timed runs
  (none when the warm-up covered every variant) and, for the 8B shape, against HF `generate` with a static
  cache under torch.compile on the same prompts;
- the share of a decode step's wall time the GPU is busy under CUDA graphs (torch.profiler), at 1 and 64.
Each measurement is skipped ("not run: time") when the step's deadline is too close. Dry run: the shape's
small variant on the CPU at small sizes (the Triton kernels in the interpreter).
"""

from __future__ import annotations

import gc
import sys
import time

import torch
from gpu_hf import hf_generate_throughput, hf_model, octavo_greedy_logits, teacher_forcing
from gpu_model_speed import Speed, figure_ratio, throughput_workload
from gpu_records import (
    CUDA,
    artifact_dir,
    check,
    checking,
    engine_config,
    figure,
    main_guard,
    model_dir,
    not_run,
    seconds_left,
)

from octavo.runtime.engine import LLMEngine
from octavo.runtime.loader import load_artifact

# Both sides round every op to bf16 (2^-9 relative), at different points: 2 x 32 sublayer outputs whose
# independent roundings add like a random walk, sqrt(64) x 2^-9 = 2^-6, bounded with 4x headroom. A wrong
# kernel (a head, a position, a slot) moves the logits by a large part of their norm.
BF16_RELATIVE = 2.0**-4
BF16_TIE_MARGIN = 2.0**-5  # of |top|, as tests/test_smollm2.py derives it for bf16 greedy tokens

TF_PROMPT_LENGTHS = [32, 77, 150, 211] if CUDA else [9, 17]
TF_TOKENS = {"smollm2-135m": 32, "llama-3.1-8b": 16} if CUDA else {"smollm2-135m": 4, "llama-3.1-8b": 4}


def check_teacher_forcing(shape: str, llm: LLMEngine, model) -> None:
    name = f"{shape}: greedy tokens under teacher forcing vs HF bf16"
    with checking(name):
        generator = torch.Generator().manual_seed(11)
        prompts = [torch.randint(100, 49000, (length,), generator=generator).tolist() for length in TF_PROMPT_LENGTHS]
        start = time.perf_counter()
        result = teacher_forcing(model, prompts, octavo_greedy_logits(llm, prompts, TF_TOKENS[shape]))
        passed = (result.max_relative_error <= BF16_RELATIVE and result.worst_gap_share <= BF16_TIE_MARGIN
                  and result.outside_top5 == 0)
        check(name, passed, f"{result.exact}/{result.positions} tokens HF's argmax; worst gap "
              f"{result.worst_gap:.3g} ({result.worst_gap_share:.2%} of |top|, margin {BF16_TIE_MARGIN:.2%}); "
              f"{result.outside_top5} outside HF's top 5; logits relative error max {result.max_relative_error:.3g}"
              f" (bound {BF16_RELATIVE:.3g}), median {result.median_relative_error:.3g}",
              time.perf_counter() - start)


def run(shape: str) -> None:
    start = time.perf_counter()
    artifact = load_artifact(artifact_dir(shape), verify=False)  # written by this check run moments ago
    llm = LLMEngine(artifact, engine_config(shape))
    check(f"{shape}: engine started", True, f"executor {llm.executor_kind}", time.perf_counter() - start)
    figure(f"{shape}: engine warm-up with the Triton cache gpu_prepare.py filled", llm.warmup_seconds, "s",
           detail="a second start of the same engine: kernels load from the cache under the Octavo cache dir")
    model = hf_model(model_dir(shape))
    check_teacher_forcing(shape, llm, model)
    speed = Speed(shape, llm)
    speed.batch_one_decode()
    speed.step_of_64()
    speed.ttft_2048()
    octavo_tok_s = speed.throughput(runs=2 if shape == "smollm2-135m" else 1)
    speed.gpu_busy()
    if shape != "llama-3.1-8b":
        return
    del llm, speed  # HF's static cache and compiled graphs get the engine's memory
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    compare_with_hf(model, octavo_tok_s)


def compare_with_hf(model, octavo_tok_s: float | None) -> None:
    name = "llama-3.1-8b: throughput vs HF generate (static cache, torch.compile)"
    if octavo_tok_s is None or seconds_left() < (150 if CUDA else 30):
        return not_run(name, "time" if octavo_tok_s is not None else "no Octavo figure", kind="figure")
    with checking(name):
        workload = throughput_workload("llama-3.1-8b")
        prompts = workload.prompts(128256)
        run = hf_generate_throughput(model, prompts, workload.output_len)
        how = "compiled by transformers (reduce-overhead)" if run.compiled else \
            "eager: transformers compiles generate only on accelerators"
        figure_ratio(name, octavo_tok_s / run.tokens_per_s, "Octavo output tok/s / HF's", ">= 2",
                     f"HF {run.tokens_per_s:.0f} tok/s in batches of {run.batch} ({how}; first pass with "
                     f"compilation {run.first_run_s:.0f}s), Octavo {octavo_tok_s:.0f} tok/s")


if __name__ == "__main__":
    main_guard(lambda: run(sys.argv[1]))
