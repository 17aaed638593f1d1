"""The engine's features through the default executor (the AOTInductor-compiled graph), against the eager engine.

The suite runs engines eagerly (tests/conftest.py), but `octavo generate/serve/bench` run the compiled
graph. Here each feature whose steps take shapes a plain decode does not (verification steps of k + 1
tokens, recomputed prefills after preemption, prefills that start past cached blocks, forks of beams and
of n > 1 samples sharing blocks) runs once through the compiled executor and once eagerly, on the same
artifact: the outputs must be the same tokens. (Quantized artifacts: test_compiled_executor.py.)

The artifact is the tiny mistral of test_compiled_executor.py (sliding-window attention), so all these
tests share its one compiled package through the session's cache: one Inductor compile, cold.

Sampled outputs (n > 1, seeded): the compiled graph's logits differ from eager's by float32 reordering
(GEMM blocking, within 1e-5 here: test_compiled_executor.py), and a seeded sample differs only where the
uniform draw falls within that distance of a boundary of the cumulative distribution: with ~50 draws a
chance of order 1e-4, and the same on every run of one machine.
"""

from __future__ import annotations

import random

import pytest
import torch

from octavo.runtime.beam_search import BeamSearchParams, beam_search
from octavo.runtime.loader import load_artifact
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import greedy, make_engine, random_tokens, run_to_completion


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    return load_artifact(tiny_artifact("mistral"))


def token_ids(engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[list[int]]]:
    """Every sample's tokens of every request, in the order they were added."""
    ids = [engine.add_request(prompt, params).request_id for prompt, params in requests]
    finals = run_to_completion(engine)
    return [[sample.token_ids for sample in sorted(finals[request_id].outputs, key=lambda s: s.index)]
            for request_id in ids]


def compiled_and_eager(artifact, requests, **options) -> tuple[list, list, list]:
    """(compiled outputs, eager outputs, the two engines), each engine run on the same requests."""
    results, engines = {}, []
    for executor in ("compiled", "eager"):
        engine = make_engine(artifact, executor=executor, **options)
        assert engine.executor_kind == executor
        results[executor] = token_ids(engine, requests)
        assert_pool_full(engine)
        engines.append(engine)
    return results["compiled"], results["eager"], engines


def test_speculative_decoding(artifact, compiled_cache):
    """N-gram proposals on repetitive prompts, always 4 (no cost model): verification steps of up to 5 tokens."""
    rng = random.Random(0)
    requests = [(random_tokens(rng, 6) * 4, greedy(24)), (random_tokens(rng, 9) * 3, greedy(20))]
    compiled, eager, (engine, _) = compiled_and_eager(artifact, requests, speculative="ngram:4:fixed", max_num_seqs=4)
    assert compiled == eager
    assert engine.speculator.stats.accepted_tokens > 0, "no proposal was accepted: the verify path did not run"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(artifact, compiled_cache, mode):
    """Six blocks of 16 tokens for four growing sequences: some are preempted and resumed (recomputed or swapped
    back in); their tokens are those of the eager engine, which is preempted alike."""
    rng = random.Random(1)
    requests = [(random_tokens(rng, 20 + 7 * index), greedy(24)) for index in range(4)]
    compiled, eager, (engine, _) = compiled_and_eager(artifact, requests, num_kv_blocks=6,
                                                      max_num_batched_tokens=32, preemption_mode=mode, max_num_seqs=4)
    assert compiled == eager
    assert engine.scheduler.preemptions[mode] > 0, f"the small pool was meant to force {mode} preemption"


def test_prefix_caching(artifact, compiled_cache):
    """Prompts that share three full blocks, added one after another: the later prefills start past cached blocks."""
    rng = random.Random(2)
    shared = random_tokens(rng, 48)
    requests = [(shared + random_tokens(rng, 5 + index), greedy(10)) for index in range(3)]
    results = {}
    for executor in ("compiled", "eager"):
        engine = make_engine(artifact, executor=executor, max_num_seqs=4)
        results[executor] = [token_ids(engine, [request]) for request in requests]
        assert engine.block_manager.prefix_cache_hits_tokens >= 2 * 48
    assert results["compiled"] == results["eager"]


def test_parallel_samples(artifact, compiled_cache):
    """n = 3 seeded samples per prompt fork from one prefill and share its blocks (copy-on-write)."""
    rng = random.Random(3)
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_tokens=12, seed=7, ignore_eos=True)
    requests = [(random_tokens(rng, 18), params), (random_tokens(rng, 33), params)]
    compiled, eager, _ = compiled_and_eager(artifact, requests, max_num_seqs=8)
    assert compiled == eager
    assert all(len(samples) == 3 for samples in compiled)
    assert len({tuple(sample) for sample in compiled[0]}) > 1, "the samples should differ from one another"


def test_beam_search(artifact, compiled_cache):
    """Beams fork from their parents and share their blocks; the same beams, scores within float32 reordering."""
    rng = random.Random(4)
    prompts = [random_tokens(rng, 12), random_tokens(rng, 21)]
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    outputs = {}
    for executor in ("compiled", "eager"):
        engine = make_engine(artifact, executor=executor, max_num_seqs=8)
        outputs[executor] = beam_search(engine, prompts, params)
        assert_pool_full(engine)
    for compiled, eager in zip(outputs["compiled"], outputs["eager"], strict=True):
        assert [beam.tokens for beam in compiled.sequences] == [beam.tokens for beam in eager.sequences]
        # 8 log-softmax values of logits within 1e-5 each (see the module docstring) sum to within 1e-4.
        torch.testing.assert_close(torch.tensor([beam.cum_logprob for beam in compiled.sequences]),
                                   torch.tensor([beam.cum_logprob for beam in eager.sequences]),
                                   atol=1e-4, rtol=0)
