"""Run a workload on the Octavo engine or on Hugging Face `generate`, timing every token."""

from __future__ import annotations

import copy
import logging
import time

import torch

from octavo.bench.results import BenchResult
from octavo.bench.workloads import Workload
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.spec_decode.metrics import SpecDecodeMetrics

logger = logging.getLogger(__name__)


def bench_params(output_len: int) -> SamplingParams:
    """Greedy, EOS ignored: every request produces exactly `output_len` tokens."""
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def run_octavo(engine: LLMEngine, workload: Workload, prompts: list[list[int]],
               params: list[SamplingParams] | None = None,
               loras: list[str | None] | None = None) -> tuple[BenchResult, list]:
    """All requests submitted at once; TTFT from submission, ITL per request. Returns outputs too.

    `params` (one per prompt) default to `bench_params(workload.output_len)`; `loras` (one per prompt)
    name the LoRA adapter each request runs under."""
    _warm_up(engine, prompts[0])
    params = params or [bench_params(workload.output_len)] * len(prompts)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params[index], request_id=f"bench-{index}",
                           lora=loras[index] if loras is not None else None)
    token_times: dict[str, list[float]] = {}
    finished = {}
    preemptions_before = engine.scheduler.num_preemptions
    hits_before = engine.block_manager.stats.hit_tokens
    speculative_before = engine.get_metrics().speculative
    memory = KVMemoryTracker(engine)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        memory.sample()
        now = time.perf_counter()
        for output in outputs:
            new_tokens = len(output.outputs[0].delta_token_ids) if output.outputs else 0
            token_times.setdefault(output.request_id, []).extend([now] * new_tokens)
            if output.finished:
                finished[output.request_id] = output
    elapsed = time.perf_counter() - start
    result = _result("octavo", workload, prompts, elapsed, start, token_times)
    result.extra["preemptions"] = engine.scheduler.num_preemptions - preemptions_before
    result.extra["prefix-cache hit tokens"] = engine.block_manager.stats.hit_tokens - hits_before
    result.extra.update(memory.summary())
    if speculative_before is not None:
        result.extra.update(speculative_figures(engine.get_metrics().speculative.since(speculative_before)))
    ordered = [finished[f"bench-{index}"].outputs[0].token_ids for index in range(len(prompts))]
    return result, ordered


def speculative_figures(metrics: SpecDecodeMetrics) -> dict[str, str]:
    """Acceptance and speed of speculative decoding, kept apart: how much was accepted, and what it bought."""
    positions = " ".join(f"{rate:.2f}" for rate in metrics.acceptance_per_position) or "-"
    return {"speculative": f"{metrics.proposer}:{metrics.max_proposed}",
            "acceptance": f"{metrics.acceptance_rate:.1%} (per position {positions})",
            "proposed": str(metrics.proposed_tokens),
            "mean accepted": f"{metrics.mean_accepted_length:.2f}",
            "tokens per verifying step": f"{metrics.tokens_per_step:.2f}",
            "estimated speedup": f"{metrics.speedup:.2f}x"}


class KVMemoryTracker:
    """Per-step KV figures: slots used vs allocated, and vs what reserving max_model_len per sequence takes."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.stored = self.allocated = self.reserved = 0

    def sample(self) -> None:
        engine = self.engine
        running = engine.scheduler.running
        if not running:
            return
        stored, slots = engine.kv_slot_counts()
        self.allocated += slots
        self.stored += stored
        self.reserved += len(running) * engine.max_model_len

    def summary(self) -> dict[str, str]:
        if not self.allocated:
            return {}
        return {"KV utilization": f"{self.stored / self.allocated:.1%} of allocated slots hold tokens",
                "paged/reserving slots": f"{self.allocated / self.reserved:.1%} (max_model_len reservation "
                                         f"would need {self.reserved / self.allocated:.1f}x)"}


def workload_blocks(workload: Workload, artifact) -> int:
    """KV blocks needed to hold every request of the workload at its full length at once."""
    block_size = artifact.kv_layout["block_size"]
    prompts = workload.prompts(artifact.manifest["vocab_size"], tokenizer=artifact.tokenizer)
    return sum(-(-(len(prompt) + workload.output_len) // block_size) for prompt in prompts)


def run_hf(model: torch.nn.Module, workload: Workload, prompts: list[list[int]], pad_token_id: int | None):
    """One request at a time through `model.generate`; TTFT from each request's own start."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class TokenClock(StoppingCriteria):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    _hf_generate(model, prompts[0][:16], 4, pad_token_id, StoppingCriteriaList())
    token_times: dict[str, list[float]] = {}
    ttfts: list[float] = []
    outputs = []
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        clock = TokenClock()
        request_start = time.perf_counter()
        generated = _hf_generate(model, prompt, workload.output_len, pad_token_id, StoppingCriteriaList([clock]))
        outputs.append(generated)
        token_times[f"bench-{index}"] = clock.times
        ttfts.append(clock.times[0] - request_start)
    elapsed = time.perf_counter() - start
    result = _result("hf", workload, prompts, elapsed, start, token_times)
    result.ttft_s = ttfts
    return result, outputs


def _hf_generate(model, prompt: list[int], num_tokens: int, pad_token_id, stopping) -> list[int]:
    """Greedy for exactly `num_tokens`, EOS ignored (not masked): an empty eos list never stops."""
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=[], max_new_tokens=num_tokens, do_sample=False, pad_token_id=pad_token_id or 0)
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                                stopping_criteria=stopping)
    return output[0, len(prompt):].tolist()


def _warm_up(engine: LLMEngine, prompt: list[int]) -> None:
    # Reversed, so that the measured run gets no prefix-cache hit from the warm-up.
    engine.add_request(prompt[:16][::-1], bench_params(4), request_id="bench-warmup")
    while engine.has_unfinished_requests():
        engine.step()


def _result(name: str, workload: Workload, prompts: list[list[int]], elapsed: float, start: float,
            token_times: dict[str, list[float]]) -> BenchResult:
    ttft = [times[0] - start for times in token_times.values() if times]
    itl = [(times[-1] - times[0]) / (len(times) - 1) for times in token_times.values() if len(times) > 1]
    output_tokens = sum(len(times) for times in token_times.values())
    return BenchResult(name, workload.name, len(prompts), sum(map(len, prompts)), output_tokens, elapsed,
                       ttft, itl)
