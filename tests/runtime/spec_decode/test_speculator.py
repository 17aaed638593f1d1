"""Speculative decoding in the engine: outputs equal plain decoding, stops, logprobs, seeds, blocks.

Greedy speculative decoding must emit exactly the tokens plain decoding emits (the reference is the
same engine without speculation), for every architecture and both proposers, whatever the batch,
the pool size (down to preemption by recompute and by swap) and the proposals: n-gram lookup,
a draft that agrees with the target (the target artifact itself) and one that rarely does (another
architecture's tiny model, same tokenizer). Every KV block, target's and draft's, is free again
at the end.
"""

from __future__ import annotations

import itertools
import random

import pytest

from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.loader import load_artifact
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import greedy, run_to_completion

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]
MAX_TOKENS = [24, 16, 20, 12]
OTHER = {"llama": "qwen2", "mistral": "llama", "qwen2": "llama", "qwen3": "llama"}


def repetitive_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts with repeated stretches, so that n-gram lookup finds matches."""
    rng = random.Random(seed)
    prompts = []
    for length in (4, 12, 30, 7):
        text = [rng.randrange(3, 49000) for _ in range(length)]
        prompts.append(text + text[: length // 2] + text)
    return prompts


def run(artifact, prompts, params, speculative=None, **options) -> tuple[list, LLMEngine]:
    """Outputs (in prompt order) of one engine run; asserts that every block came back."""
    options.setdefault("num_kv_blocks", 64)
    engine = LLMEngine(artifact, EngineConfig(speculative=speculative, **options))
    params = params if isinstance(params, list) else [params] * len(prompts)
    for index, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, request_params, request_id=str(index))
    finals = run_to_completion(engine)
    assert_pool_full(engine)
    assert_draft_pool_full(engine)
    return [finals[str(index)] for index in range(len(prompts))], engine


def assert_draft_pool_full(engine: LLMEngine) -> None:
    proposer = engine.speculator.proposer if engine.speculator is not None else None
    manager = getattr(proposer, "block_manager", None)
    if manager is not None:
        assert manager.num_free_blocks == manager.num_blocks, "draft KV blocks leaked"
        assert not proposer.states


def tokens(outputs) -> list[list[list[int]]]:
    return [[completion.token_ids for completion in output.outputs] for output in outputs]


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts()


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_tokens_equal_plain_decoding(tiny_artifact, architecture, prompts):
    artifact = load_artifact(tiny_artifact(architecture))
    params = [greedy(count) for count in MAX_TOKENS]
    plain = tokens(run(artifact, prompts, params)[0])
    for speculative in ("ngram:4:fixed", f"draft:{tiny_artifact(architecture)}:3:fixed",
                        f"draft:{tiny_artifact(OTHER[architecture])}:2:fixed"):
        outputs, engine = run(artifact, prompts, params, speculative)
        assert tokens(outputs) == plain, speculative
        metrics = engine.get_metrics().speculative
        assert metrics.proposed_tokens > 0, speculative
        if speculative.startswith("ngram") or f"draft:{tiny_artifact(architecture)}:" in speculative:
            assert metrics.accepted_tokens > 0, speculative


@pytest.mark.parametrize("options", [
    {"num_kv_blocks": 8, "max_num_batched_tokens": 16},
    {"num_kv_blocks": 8, "max_num_batched_tokens": 16, "preemption_mode": "swap", "swap_space": "1MiB"},
    {"max_num_batched_tokens": 6, "max_num_seqs": 3},
], ids=["recompute", "swap", "tiny-budget"])
def test_preemption_and_small_budgets_keep_greedy_tokens(artifact, prompts, options):
    params = [greedy(count) for count in MAX_TOKENS]
    plain = tokens(run(artifact, prompts, params, **options)[0])
    for speculative in ("ngram:4:fixed", f"draft:{artifact.path}:3:fixed"):
        outputs, engine = run(artifact, prompts, params, speculative, **options)
        assert tokens(outputs) == plain, speculative
        if "num_kv_blocks" in options:
            assert engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
        largest = engine.last_step.schedule.num_batched_tokens
        assert largest <= engine.config.max_num_batched_tokens


def test_stops_inside_an_accepted_run_end_the_sequence_there(artifact, prompts):
    """Stop tokens, stop strings and max_tokens cut a run of accepted proposals at the right token; min_tokens
    bans a stop token from the proposals' positions too."""
    reference = run(artifact, prompts[2:3], greedy(24))[0][0].outputs[0]
    stop_token = reference.token_ids[9]
    stop_text = artifact.tokenizer.decode(reference.token_ids[13:15])
    cases = [greedy(24, stop_token_ids=[stop_token]), greedy(24, stop=[stop_text]), greedy(11),
             greedy(24, stop_token_ids=[stop_token], include_stop_str_in_output=True),
             greedy(24, stop_token_ids=[stop_token], min_tokens=12)]  # the stop token is banned until 12 tokens
    plain = run(artifact, prompts[2:3] * len(cases), cases)[0]
    for speculative in ("ngram:4:fixed", f"draft:{artifact.path}:4:fixed"):
        outputs = run(artifact, prompts[2:3] * len(cases), cases, speculative)[0]
        for case, expected, got in zip(cases, plain, outputs, strict=True):
            assert got.outputs[0].token_ids == expected.outputs[0].token_ids, case
            assert got.outputs[0].text == expected.outputs[0].text, case
            assert got.outputs[0].finish_reason == expected.outputs[0].finish_reason, case
            assert got.outputs[0].stop_reason == expected.outputs[0].stop_reason, case
    assert len(plain[0].outputs[0].token_ids) == 10 and plain[0].outputs[0].finish_reason == "stop"


def test_logprobs_of_every_emitted_token_match_plain_decoding(artifact, prompts):
    params = greedy(20, logprobs=3)
    plain = run(artifact, prompts[1:3], params)[0]
    outputs = run(artifact, prompts[1:3], params, "ngram:4:fixed")[0]
    for expected, got in zip(plain, outputs, strict=True):
        expected, got = expected.outputs[0], got.outputs[0]
        assert len(got.logprobs) == len(got.token_ids) == len(expected.logprobs)
        for want, have in zip(expected.logprobs, got.logprobs, strict=True):
            assert list(want) == list(have)  # the same tokens, in the same order (rank)
            for token in want:
                assert have[token].rank == want[token].rank
                # One verification row and one decode row differ only by float32 reassociation.
                assert have[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)
        assert got.cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=1e-3)


def test_seeded_sampling_is_unchanged_by_ngram_speculation(artifact, prompts):
    """With n-gram proposals the verifier draws exactly one noise vector per emitted token from the
    request's generator, as plain sampling does: a seeded request emits the same tokens."""
    # The bias keeps the output to a few tokens, so that it repeats and n-gram lookup proposes.
    few = {token: 30.0 for token in prompts[2][:3]}
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.1, logit_bias=few) for seed in range(4)]
    plain = tokens(run(artifact, prompts, params)[0])
    outputs, engine = run(artifact, prompts, params, "ngram:3:fixed")
    assert tokens(outputs) == plain
    assert engine.get_metrics().speculative.accepted_tokens > 0


def test_blocks_come_back_after_forks_aborts_and_rejections(artifact, prompts):
    engine = LLMEngine(artifact, EngineConfig(num_kv_blocks=24, speculative=f"draft:{artifact.path}:3:fixed"))
    sampled = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=30, ignore_eos=True)
    engine.add_request(prompts[2], sampled, request_id="forks")
    engine.add_request(prompts[1], greedy(40), request_id="aborted-running")
    engine.add_request(prompts[3], greedy(40), request_id="aborted-waiting")
    engine.add_request(prompts[0], SamplingParams(temperature=1.0, seed=2, max_tokens=25), request_id="sampled")
    for _ in range(4):
        engine.step()
    assert engine.get_metrics().speculative.proposed_tokens > 0
    engine.abort_request("aborted-running")
    engine.abort_request("aborted-waiting")
    finals = run_to_completion(engine)
    assert [len(completion.token_ids) for completion in finals["forks"].outputs] == [30, 30, 30]
    assert_pool_full(engine)
    assert_draft_pool_full(engine)


def test_opted_out_requests_do_not_speculate(artifact, prompts):
    params = greedy(16, speculative=False)
    outputs, engine = run(artifact, prompts, params, "ngram:4:fixed")
    assert engine.get_metrics().speculative.proposed_tokens == 0
    assert tokens(outputs) == tokens(run(artifact, prompts, params)[0])


def test_metrics_count_proposals_acceptance_and_emitted_tokens(artifact, prompts):
    _, engine = run(artifact, prompts, [greedy(count) for count in MAX_TOKENS], "ngram:4:fixed")
    metrics = engine.get_metrics().speculative
    assert metrics.proposer == "ngram" and metrics.max_proposed == 4
    assert 0 < metrics.accepted_tokens <= metrics.proposed_tokens
    assert sum(metrics.proposed_per_position) == metrics.proposed_tokens
    assert sum(metrics.accepted_per_position) == metrics.accepted_tokens
    # A proposal is only accepted after the ones before it.
    accepted = metrics.accepted_per_position
    assert all(later <= earlier for earlier, later in itertools.pairwise(accepted))
    # Every verification emits its accepted proposals and one token of the target (no stop inside runs here).
    assert metrics.emitted_tokens == metrics.accepted_tokens + metrics.num_verifications
    assert metrics.tokens_per_step == pytest.approx(1 + metrics.mean_accepted_length)
    assert metrics.speculative_seconds > 0 and metrics.speedup > 0
