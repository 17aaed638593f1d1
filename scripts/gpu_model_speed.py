"""The speed figures of scripts/gpu_model_check.py, each measured on the engine and read against a ceiling
measured in the same process (copy bandwidth, bf16 matmul rate: octavo.bench.roofline)."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch
from gpu_records import CUDA, DRY_RUN, DRY_SHAPES, ceilings, checking, figure, not_run, seconds_left, sync

from octavo.bench.random_model import parameter_count, random_config
from octavo.bench.runners import run_octavo
from octavo.bench.workloads import Workload, get_workload
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams

BIG = "llama-3.1-8b"


def throughput_workload(shape: str) -> Workload:
    workload = get_workload("throughput")
    if DRY_RUN:
        return dataclasses.replace(workload, num_requests=4, prompt_len_min=16, prompt_len_max=32, output_len=8)
    return dataclasses.replace(workload, num_requests=256 if shape == BIG else 64)


def single_workload() -> Workload:
    workload = get_workload("single")
    if DRY_RUN:
        return dataclasses.replace(workload, prompt_len_min=16, prompt_len_max=16, output_len=8)
    return workload


def figure_ratio(name: str, ratio: float, ratio_of: str, target: str, detail: str) -> None:
    figure(name, ratio, "x", ratio=ratio, ratio_of=ratio_of, target=target, detail=detail)


def compiled_variants() -> int:
    """Kernel variants Triton holds in this process for Octavo's kernels (0 in the interpreter)."""
    count = 0
    for name, module in list(sys.modules.items()):
        if not (name.startswith("octavo.codegen.triton_backend") or name.startswith("octavo_generated_")):
            continue
        for value in vars(module).values():
            caches = getattr(value, "device_caches", None)
            if isinstance(caches, dict):
                count += sum(len(entry[0]) for entry in caches.values())
    return count


class Speed:
    """The figures of one engine; each method records its figure, or "not run: time" near the deadline."""

    def __init__(self, shape: str, llm: LLMEngine):
        self.shape, self.llm = shape, llm
        config = random_config(shape, **(DRY_SHAPES[shape] if DRY_RUN else {}))
        params, table = parameter_count(config), config.vocab_size * config.hidden_size
        self.vocab_size = config.vocab_size
        # A decode step reads every weight once, except the embedding table (a row per token) when untied.
        self.weight_bytes = 2 * (params - (0 if config.tie_word_embeddings else table))
        self.layer_params = params - table * (1 if config.tie_word_embeddings else 2)
        self.lm_head_params = table
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_bytes_per_token = 2 * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim
        self.copy_bandwidth, self.matmul_flops = ceilings()

    def _time_left(self, name: str, needed: float) -> bool:
        if seconds_left() < needed:
            not_run(name, "time", kind="figure")
            return False
        return True

    def batch_one_decode(self) -> None:
        name = f"{self.shape}: batch-1 decode inter-token latency"
        if not self._time_left(name, 20):
            return
        with checking(name):
            workload = single_workload()
            prompts = workload.prompts(self.vocab_size)
            result, _ = run_octavo(self.llm, workload, prompts)
            itl = result.itl_s[0]
            context = len(prompts[0]) + workload.output_len // 2
            ceiling = (self.weight_bytes + context * self.kv_bytes_per_token) / self.copy_bandwidth
            target = ">= 0.8 of the ceiling" if self.shape == BIG else "ITL <= 0.4 ms"
            figure(name, itl * 1e3, "ms", ratio=ceiling / itl, ratio_of="bandwidth ceiling / ITL (weight + KV bytes "
                   "over copy bandwidth)", target=target, detail=f"ceiling {ceiling * 1e3:.3f} ms; `single` workload "
                   f"({len(prompts[0])} in, {workload.output_len} out){', CUDA graphs' if CUDA else ''}")

    def step_of_64(self) -> None:
        name = f"{self.shape}: 64-sequence decode step"
        if not self._time_left(name, 20):
            return
        with checking(name):
            count = 64 if CUDA else 4
            prompts = dataclasses.replace(throughput_workload(self.shape), seed=5).prompts(self.vocab_size)[:count]
            self._start_decoding(prompts, "s64")
            times = []
            for _ in range(16 if CUDA else 3):
                sync()
                start = time.perf_counter()
                self.llm.step()
                sync()
                times.append(time.perf_counter() - start)
            context = sum(seq.num_computed_tokens for seq in self.llm.scheduler.running)
            self._abort("s64", count)
            step = statistics.median(times)
            floor = (self.weight_bytes + context * self.kv_bytes_per_token) / self.copy_bandwidth
            figure(name, step * 1e3, "ms", ratio=step / floor, ratio_of="step time / (weight + KV bytes over copy "
                   "bandwidth)", target="<= 2" if self.shape != BIG else "", detail=f"{count} sequences, "
                   f"{context} context tokens, floor {floor * 1e3:.3f} ms; median of {len(times)} engine steps")

    def ttft_2048(self) -> None:
        name = f"{self.shape}: TTFT of a 2048-token prompt"
        if not self._time_left(name, 20):
            return
        with checking(name):
            tokens = 2048 if CUDA else 64
            times = []
            for run in range(3 if CUDA else 1):  # a new prompt each time: no prefix-cache hit
                prompt = torch.randint(100, 49000, (tokens,), generator=torch.Generator().manual_seed(run)).tolist()
                start = time.perf_counter()
                self.llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                while self.llm.has_unfinished_requests():
                    self.llm.step()
                times.append(time.perf_counter() - start)
            ttft = statistics.median(times)
            limit = (2 * self.layer_params * tokens + 2 * self.lm_head_params) / self.matmul_flops
            figure(name, ttft * 1e3, "ms", ratio=ttft / limit, ratio_of="TTFT / GEMM-bound limit (2 x layer "
                   "parameters x tokens + the lm_head row, over the bf16 matmul rate)", target="<= 1.3",
                   detail=f"{tokens} tokens, limit {limit * 1e3:.2f} ms, median of {len(times)}")

    def throughput(self, runs: int) -> float | None:
        """Output tok/s of the `throughput` workload (the last run); with 2 runs, the first against the second."""
        name = f"{self.shape}: throughput workload"
        if not self._time_left(name, 60 if CUDA else 10):
            return None
        before = compiled_variants()
        results = []
        with checking(name):
            workload = throughput_workload(self.shape)
            for run in range(runs):  # another seed each run: the same shape, no prefix-cache hits
                prompts = dataclasses.replace(workload, seed=workload.seed + run).prompts(self.vocab_size)
                results.append(run_octavo(self.llm, workload, prompts)[0])
            first, last = results[0].output_tokens_per_s, results[-1].output_tokens_per_s
            figure(name, first, "output tok/s", ratio=first / last if runs > 1 else None,
                   ratio_of="first run / second run" if runs > 1 else "",
                   target="first run as fast as the second" if runs > 1 else "",
                   detail=f"{workload.num_requests} requests, {workload.output_len} out; runs: "
                   + ", ".join(f"{result.output_tokens_per_s:.0f}" for result in results))
            figure(f"{self.shape}: Triton kernel variants first used during the timed runs",
                   compiled_variants() - before, "variants", target="0 (the warm-up compiled every variant)",
                   detail="counted in Triton's per-kernel caches (compiled, or loaded from its disk cache)" if CUDA
                   else "not measurable in the interpreter")
        return results[-1].output_tokens_per_s if results else None

    def gpu_busy(self) -> None:
        for batch in (1, 64):
            name = f"{self.shape}: GPU busy share of a decode step at {batch} sequence(s)"
            if not CUDA:
                not_run(name, "no CUDA device", kind="figure")
            elif self._time_left(name, 20):
                with checking(name):
                    self._gpu_busy(name, batch)

    def _gpu_busy(self, name: str, batch: int) -> None:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        prompts = dataclasses.replace(throughput_workload(self.shape), seed=7).prompts(self.vocab_size)[:batch]
        self._start_decoding(prompts, "busy")
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            for _ in range(10):
                self.llm.step()
            sync()
        self._abort("busy", batch)
        spans = sorted((event.time_range.start, event.time_range.end) for event in profiler.events()
                       if event.device_type == DeviceType.CUDA)
        if not spans:
            return not_run(name, "the profiler recorded no device activity", kind="figure")
        busy, end = 0.0, spans[0][0]
        for start, stop in spans:
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
        share = busy / (end - spans[0][0])
        figure(name, share, "share", ratio=share, ratio_of="union of device activity / span of 10 steps",
               target=">= 0.9", detail="torch.profiler (CUPTI) over 10 engine steps under CUDA graphs")

    def _start_decoding(self, prompts: list[list[int]], prefix: str) -> None:
        for index, prompt in enumerate(prompts):
            self.llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                                 request_id=f"{prefix}{index}")
        scheduler = self.llm.scheduler
        while scheduler.waiting or any(seq.num_output_tokens == 0 for seq in scheduler.running):
            self.llm.step()

    def _abort(self, prefix: str, count: int) -> None:
        for index in range(count):
            self.llm.abort_request(f"{prefix}{index}")
