"""Tensor parallelism composes with speculative decoding, beam search and quantized artifacts.

(Prefix caching, copy-on-write, swapping and recompute preemption run on
parallel engines in test_parallel_engine.py.)

- Speculative decoding: the draft proposes on rank 0 alone, every rank verifies.
  The tiny llama drafts for itself, so the draft and the target agree and
  proposals are accepted; greedy verification keeps the target's tokens,
  which must equal the plain single-process engine's.
- Beam search: beams fork sequences that share blocks (copy-on-write copies
  every rank repeats); the beams, their tokens and their log-probabilities
  must equal the single-process engine's (float32, two ranks: sharding only
  reorders sums, ~1e-6 on a log-probability).
- Quantized (w4 linears, int8 vocabulary, int8 KV cache), the machine's own
  kernels: each rank splits qweight, scales and offsets on group boundaries.
  Those kernels may compute a step of more than 8 rows in bfloat16 (where the
  CPU has it natively): activations rounded to 8 significant bits, i.e. a
  relative error of up to 2^-8, and the ranks round their partial sums
  separately. A few such roundings on logits of magnitude < 8 stay below
  QUANTIZED_ATOL = 4 x 2^-8 x 8 = 0.125 (float32 machines: ~1e-6). Its
  tokens can flip at near ties (the tiny model has leads of 0.01), so the
  check scores prompts instead of generating.
"""

from __future__ import annotations

import pytest
import torch

from octavo.config import EngineConfig
from octavo.llm import LLM
from octavo.parallel import create_engine
from octavo.runtime.beam_search import BeamSearchParams, beam_search
from octavo.runtime.loader import load_artifact
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import greedy, make_engine, run_to_completion

pytestmark = pytest.mark.usefixtures("one_thread")

POOL = {"num_kv_blocks": 48, "max_num_batched_tokens": 64, "max_num_seqs": 8, "num_threads": 1}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(100, 140)), [3000, 41, 977, 12, 5]]
QUANTIZED_ATOL = 4 * 2**-8 * 8


# First: a process runs one parallel engine at a time, and the module's speculative engine lives until the end.
def test_a_quantized_artifact_on_two_ranks_computes_the_single_process_logits(tiny_quantized_artifact):
    """Every prompt position is scored (prompt logprobs), in chunks of at most 16 tokens that read the int8
    cache the earlier chunks wrote; no sampled token feeds back, so near ties cannot steer the two apart."""
    path = tiny_quantized_artifact("llama", quant="w4", kv_cache_dtype="int8")
    options = {**POOL, "max_num_batched_tokens": 16}
    reference = LLM(path, **options).engine
    parallel = create_engine(path, EngineConfig(**options, tensor_parallel_size=2))
    try:
        assert parallel.kv_cache.layout["num_kv_heads"] == 1
        for engine in (reference, parallel):
            for index, prompt in enumerate(PROMPTS):
                engine.add_request(prompt, greedy(1, prompt_logprobs=1), request_id=f"w4-{index}")
        rows = 0
        while reference.has_unfinished_requests() or parallel.has_unfinished_requests():
            reference.step()
            parallel.step()
            torch.testing.assert_close(parallel.last_step.logits, reference.last_step.logits, rtol=0,
                                       atol=QUANTIZED_ATOL)
            rows += reference.last_step.logits.shape[0]
        assert rows == sum(len(prompt) for prompt in PROMPTS)  # every position but the first, plus one sample each
        assert_pool_full(parallel)
    finally:
        parallel.shutdown()


@pytest.fixture(scope="module")
def llama(tiny_artifact):
    return load_artifact(tiny_artifact("llama"))


@pytest.fixture(scope="module")
def speculative_engine(llama):
    engine = create_engine(llama, EngineConfig(**POOL, tensor_parallel_size=2,
                                               speculative=f"draft:{llama.path}:3:fixed"))
    yield engine
    engine.shutdown()


def test_a_draft_on_rank_0_proposes_and_every_rank_verifies(llama, speculative_engine):
    reference = make_engine(llama, **POOL)
    outputs = []
    for engine in (reference, speculative_engine):
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(prompt, greedy(16), request_id=f"spec-{index}")
        outputs.append({key: output.outputs[0].token_ids for key, output in run_to_completion(engine).items()})
    assert outputs[1] == outputs[0]
    metrics = speculative_engine.speculator.metrics()
    assert metrics.accepted_tokens > 0 and metrics.num_verify_steps > 0
    assert_pool_full(speculative_engine)


def test_beams_on_two_ranks_equal_the_single_process_beams(llama, speculative_engine):
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    expected = beam_search(make_engine(llama, **POOL), PROMPTS[1:], params)
    got = beam_search(speculative_engine, PROMPTS[1:], params)
    for want, have in zip(expected, got, strict=True):
        assert [beam.tokens for beam in have.sequences] == [beam.tokens for beam in want.sequences]
        torch.testing.assert_close([beam.cum_logprob for beam in have.sequences],
                                   [beam.cum_logprob for beam in want.sequences], rtol=0, atol=1e-5)
    assert_pool_full(speculative_engine)
