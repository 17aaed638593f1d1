"""LLMEngine on a tiny compiled artifact: batching invariance, preemption, rejection, abort, stops, n, seeds.

Greedy tokens of a prompt run alone are the reference: whatever the token
budget, the sequence cap or the KV pool size (down to a pool so small that
sequences are preempted and recomputed), the same prompts give the same tokens.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from octavo.errors import RequestError
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import greedy, make_engine, run_to_completion

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENGTHS = [3, 17, 40, 9, 25, 60]
MAX_TOKENS = [20, 12, 16, 24, 8, 14]
TEXT_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 49000) for _ in range(length)] for length in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def alone_tokens(artifact, prompts) -> list[list[int]]:
    """Each prompt's greedy tokens when it is the only request."""
    engine = make_engine(artifact)
    tokens = []
    for prompt, max_tokens in zip(prompts, MAX_TOKENS, strict=True):
        engine.add_request(prompt, greedy(max_tokens), request_id="alone")
        tokens.append(run_to_completion(engine)["alone"].outputs[0].token_ids)
    assert_pool_full(engine)
    return tokens


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 1024, "max_num_seqs": 128},
    {"max_num_batched_tokens": 7, "max_num_seqs": 3},
    {"max_num_batched_tokens": 24, "max_num_seqs": 6, "num_kv_blocks": 5},  # 80 slots: the longest needs 74
], ids=["roomy", "tiny-budget-and-cap", "small-pool"])
def test_greedy_tokens_do_not_depend_on_batching_or_pool_size(artifact, prompts, alone_tokens, options):
    engine = make_engine(artifact, **options)
    for index, (prompt, max_tokens) in enumerate(zip(prompts, MAX_TOKENS, strict=True)):
        engine.add_request(prompt, greedy(max_tokens), request_id=str(index))
    largest_step = 0
    while engine.has_unfinished_requests():
        finals = engine.step()
        largest_step = max(largest_step, engine.last_step.schedule.num_batched_tokens)
        assert len(engine.last_step.schedule.scheduled) <= engine.config.max_num_seqs
        for output in finals:
            if output.finished:
                index = int(output.request_id)
                assert output.outputs[0].token_ids == alone_tokens[index], f"prompt {index} differs"
                assert output.outputs[0].finish_reason == "length"
    assert largest_step <= engine.config.max_num_batched_tokens
    if options.get("num_kv_blocks", 64) < 10:
        assert engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    assert_pool_full(engine)


def test_sequences_never_outgrow_a_pool_smaller_than_max_model_len(artifact):
    engine = make_engine(artifact, num_kv_blocks=2, max_num_batched_tokens=8)  # 32 token slots
    assert engine.max_model_len == 32
    engine.add_request(list(range(100, 110)), greedy(40), request_id="grows")
    with pytest.raises(RequestError, match="max_model_len is 32"):
        engine.add_request(list(range(100, 140)), greedy(4))
    output = run_to_completion(engine)["grows"]
    assert output.outputs[0].finish_reason == "length"
    assert len(output.outputs[0].token_ids) == 32 - 10
    assert_pool_full(engine)


@pytest.mark.parametrize(("limit", "prompt_length"), [(64, 100), (None, 600)], ids=["configured", "model"])
def test_too_long_prompt_is_rejected_alone(artifact, limit, prompt_length):
    from octavo.llm import LLM

    llm = LLM(artifact.path, num_kv_blocks=64, max_model_len=limit)
    expected_limit = limit or 512
    rng = random.Random(3)
    long_prompt = [rng.randrange(3, 49000) for _ in range(prompt_length)]
    outputs = llm.generate([TEXT_PROMPT, long_prompt, [5, 6, 7]], greedy(6))
    assert [output.request_id for output in outputs] == ["generate-0", "generate-1", "generate-2"]
    rejected = outputs[1]
    assert rejected.finished and rejected.outputs == []
    assert rejected.error == (f"the prompt has {prompt_length} tokens, but the model's max_model_len is "
                              f"{expected_limit}; the prompt plus at least one generated token must fit")
    for output in (outputs[0], outputs[2]):
        assert output.error is None
        assert len(output.outputs[0].token_ids) == 6 and output.outputs[0].finish_reason == "length"
    assert_pool_full(llm.engine)


def test_prompt_one_short_of_max_model_len_gets_exactly_one_token(artifact):
    engine = make_engine(artifact, max_model_len=20)
    engine.add_request(list(range(100, 119)), greedy(10), request_id="fits")
    with pytest.raises(RequestError, match="the prompt has 20 tokens, but the model's max_model_len is 20"):
        engine.add_request(list(range(100, 120)), greedy(10))
    completion = run_to_completion(engine)["fits"].outputs[0]
    assert len(completion.token_ids) == 1 and completion.finish_reason == "length"
    assert_pool_full(engine)


def test_invalid_request_raises_and_changes_nothing(artifact):
    engine = make_engine(artifact)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([1, 2, 49152], greedy(4))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("", greedy(4))
    with pytest.raises(RequestError, match="stop_token_ids"):
        engine.add_request([1, 2], greedy(4, stop_token_ids=[10**6]))
    engine.add_request([1, 2], greedy(4), request_id="x")
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([1, 2], greedy(4), request_id="x")
    assert list(engine.requests) == ["x"]
    run_to_completion(engine)
    assert_pool_full(engine)


def test_abort_frees_the_blocks_at_once(artifact, prompts):
    engine = make_engine(artifact, max_num_seqs=2)
    engine.add_request(prompts[5], greedy(30), request_id="long")   # 60 tokens: 4 blocks
    engine.add_request(prompts[0], greedy(30), request_id="short")  # 3 tokens: 1 block
    engine.add_request(prompts[1], greedy(30), request_id="queued")  # waits: max_num_seqs=2
    for _ in range(3):
        engine.step()
    long_seq = engine.requests["long"].sequences[0]
    short_seq = engine.requests["short"].sequences[0]
    assert len(long_seq.block_table) == 4
    output = engine.abort_request("long")
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert len(output.outputs[0].token_ids) == 3
    assert long_seq.block_table == []
    assert engine.block_manager.num_used_blocks == len(short_seq.block_table)
    queued = engine.abort_request("queued")  # still waiting, never scheduled
    assert queued.outputs[0].finish_reason == "abort" and queued.outputs[0].token_ids == []
    assert [seq.request_id for seq in engine.scheduler.waiting] == []
    assert engine.abort_request("queued") is None
    assert engine.abort_request("no-such-request") is None
    finals = run_to_completion(engine)
    assert list(finals) == ["short"]
    assert len(finals["short"].outputs[0].token_ids) == 30
    assert_pool_full(engine)


@pytest.fixture(scope="module")
def reference_text(artifact):
    """Greedy output of TEXT_PROMPT without stops: (text, token ids)."""
    engine = make_engine(artifact)
    engine.add_request(TEXT_PROMPT, greedy(24), request_id="ref")
    completion = run_to_completion(engine)["ref"].outputs[0]
    assert_pool_full(engine)
    return completion.text, completion.token_ids


def generate_one(artifact, prompt, params: SamplingParams):
    engine = make_engine(artifact)
    engine.add_request(prompt, params, request_id="one")
    output = run_to_completion(engine)["one"]
    assert_pool_full(engine)
    return output


def _stop_string_from(text: str) -> tuple[int, str]:
    """A 3-character ASCII stop string whose first occurrence starts in the middle of `text`."""
    for start in range(len(text) // 3, len(text) - 3):
        candidate = text[start:start + 3]
        if candidate.isascii() and candidate.strip() and text.find(candidate) == start:
            return start, candidate
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_the_text(artifact, reference_text, include):
    full_text, full_ids = reference_text
    start, stop = _stop_string_from(full_text)
    output = generate_one(artifact, TEXT_PROMPT, greedy(24, stop=["@@never@@", stop],
                                                        include_stop_str_in_output=include))
    completion = output.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full_text[:start + (len(stop) if include else 0)]
    ids = completion.token_ids
    assert ids == full_ids[:len(ids)] and len(ids) < len(full_ids)
    # Generation stopped at the token that completed the stop string, not later.
    shorter = generate_one(artifact, TEXT_PROMPT, greedy(len(ids) - 1)).outputs[0].text
    assert stop not in shorter


def test_stop_token_id_ends_generation_and_its_text_is_dropped(artifact, reference_text):
    _, full_ids = reference_text
    index = next(i for i in range(4, len(full_ids)) if full_ids[i] not in full_ids[:i])
    stop_token = full_ids[index]
    output = generate_one(artifact, TEXT_PROMPT, greedy(24, stop_token_ids=[stop_token]))
    completion = output.outputs[0]
    assert completion.token_ids == full_ids[:index + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_token
    before = generate_one(artifact, TEXT_PROMPT, greedy(index)).outputs[0]
    assert completion.text == before.text


def test_max_tokens_finishes_with_length(artifact, reference_text):
    _, full_ids = reference_text
    completion = generate_one(artifact, TEXT_PROMPT, greedy(5)).outputs[0]
    assert completion.token_ids == full_ids[:5]
    assert completion.finish_reason == "length" and completion.stop_reason is None


def test_eos_stops_unless_ignored(artifact):
    engine = make_engine(artifact)
    eos = engine.eos_token_ids[0]
    push_eos = {eos: 100.0}
    stopped = generate_one(artifact, TEXT_PROMPT, SamplingParams(temperature=0, max_tokens=5, logit_bias=push_eos))
    completion = stopped.outputs[0]
    assert completion.token_ids == [eos]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.text == ""
    ignored = generate_one(artifact, TEXT_PROMPT, SamplingParams(temperature=0, max_tokens=3, logit_bias=push_eos,
                                                                 ignore_eos=True))
    assert ignored.outputs[0].token_ids == [eos] * 3 and ignored.outputs[0].finish_reason == "length"


def test_n_2_returns_two_completions_each_equal_to_its_seeded_single_run(artifact):
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    output = generate_one(artifact, TEXT_PROMPT, params)
    assert [completion.index for completion in output.outputs] == [0, 1]
    assert all(len(completion.token_ids) == 10 for completion in output.outputs)
    assert output.outputs[0].token_ids != output.outputs[1].token_ids
    for index in (0, 1):
        single = generate_one(artifact, TEXT_PROMPT, params.clone(n=1, seed=11 + index))
        assert single.outputs[0].token_ids == output.outputs[index].token_ids
        assert single.outputs[0].text == output.outputs[index].text


def test_seeded_sampling_is_reproducible_whatever_else_is_batched(artifact, prompts):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = generate_one(artifact, prompts[2], seeded).outputs[0].token_ids
    engine = make_engine(artifact, max_num_batched_tokens=9, max_num_seqs=4, num_kv_blocks=7)
    engine.add_request(prompts[5], SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True))
    engine.add_request(prompts[1], SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True))
    engine.add_request(prompts[2], seeded, request_id="seeded")
    engine.add_request(prompts[3], SamplingParams(n=2, temperature=0.7, max_tokens=12, ignore_eos=True))
    finals = run_to_completion(engine)
    assert finals["seeded"].outputs[0].token_ids == alone
    assert engine.scheduler.num_preemptions > 0
    assert_pool_full(engine)


def test_streamed_deltas_concatenate_to_the_final_outputs(artifact, reference_text):
    full_text, _ = reference_text
    _, stop = _stop_string_from(full_text)
    engine = make_engine(artifact, max_num_batched_tokens=6)
    engine.add_request(TEXT_PROMPT, greedy(24, stop=[stop]), request_id="stop-string")
    engine.add_request(TEXT_PROMPT, greedy(24), request_id="plain")
    engine.add_request("Hello, my name is", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12),
                       request_id="two")
    texts, tokens, counts, finals = defaultdict(str), defaultdict(list), defaultdict(int), {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id not in finals, "no output after the final one"
            counts[output.request_id] += 1
            for completion in output.outputs:
                key = (output.request_id, completion.index)
                texts[key] += completion.delta_text
                tokens[key] += completion.delta_token_ids
                assert completion.text == texts[key], "text so far = concatenated deltas"
                assert completion.token_ids == tokens[key]
            if output.finished:
                finals[output.request_id] = output
    assert finals["plain"].outputs[0].text == full_text
    for request_id, output in finals.items():
        assert counts[request_id] > 2
        for completion in output.outputs:
            assert texts[(request_id, completion.index)] == completion.text
            assert tokens[(request_id, completion.index)] == completion.token_ids
    assert stop not in texts[("stop-string", 0)]
    assert_pool_full(engine)
