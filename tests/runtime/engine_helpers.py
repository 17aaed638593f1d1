"""Helpers of the engine tests: build an engine, run it until idle, greedy parameters, random prompts."""

from __future__ import annotations

import random

from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.outputs import RequestOutput
from octavo.runtime.sampling_params import SamplingParams


def make_engine(artifact, **options) -> LLMEngine:
    options.setdefault("num_kv_blocks", 64)
    return LLMEngine(artifact, EngineConfig(**options))


def run_to_completion(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until idle; the last output of every request, by id."""
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def greedy(max_tokens: int, **extra) -> SamplingParams:
    """Greedy with EOS ignored: exactly `max_tokens` tokens."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def random_tokens(rng: random.Random, length: int) -> list[int]:
    """`length` token ids clear of the tokenizer's special ids (0-2)."""
    return [rng.randrange(3, 49000) for _ in range(length)]


def observe_recompute_preemptions(engine: LLMEngine, last_computed: dict[str, int]) -> int:
    """Preemptions by recompute since the previous call, counted from what the sequences show.

    A recompute preemption sends a sequence back to zero computed tokens (and
    it cannot be re-admitted in the step that preempted it), so a fall in a
    sequence's computed-token count between two steps is one preemption.
    `last_computed` (sequence id -> computed tokens) carries the previous view.
    """
    preempted = 0
    for request in engine.requests.values():
        for seq in request.sequences:
            if seq.num_computed_tokens < last_computed.get(seq.seq_id, 0):
                preempted += 1
            last_computed[seq.seq_id] = seq.num_computed_tokens
    return preempted
