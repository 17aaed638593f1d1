"""The official `openai` client against `octavo serve` of a tiny model: n=2, logprobs, models, errors.

Outputs are compared with LLM.generate on the same artifact (seeded sampling draws the same tokens).
"""

from __future__ import annotations

import openai
import pytest

from octavo.runtime.sampling_params import SamplingParams
from tests.serve.conftest import TINY_MAX_MODEL_LEN

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_n2_seeded_sampling_equals_offline(client, tiny_server, tiny_offline):
    params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=8)
    response = client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=8, n=2,
                                         temperature=0.8, seed=11)
    expected = tiny_offline.generate(PROMPT, params)[0]
    assert [choice.index for choice in response.choices] == [0, 1]
    assert [choice.text for choice in response.choices] == [output.text for output in expected.outputs]
    assert response.choices[0].text != response.choices[1].text
    assert response.usage.completion_tokens == sum(len(output.token_ids) for output in expected.outputs)

    stream = client.chat.completions.create(model=tiny_server.model, messages=MESSAGES, max_tokens=8, n=2,
                                            temperature=0.8, seed=11, stream=True)
    texts, finish_reasons = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish_reasons[choice.index] = choice.finish_reason
    expected_chat = tiny_offline.chat(MESSAGES, params)[0]
    assert finish_reasons == {0: "length", 1: "length"}
    assert [texts[0], texts[1]] == [output.text for output in expected_chat.outputs]


def test_completion_logprobs_equal_offline(client, tiny_server, tiny_offline):
    response = client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                         logprobs=3)
    expected = tiny_offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0].outputs[0]
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text == expected.text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    for position, (token_id, entry) in enumerate(zip(expected.token_ids, expected.logprobs, strict=True)):
        assert logprobs.token_logprobs[position] == pytest.approx(entry[token_id].logprob, abs=1e-5)
        alternatives = logprobs.top_logprobs[position]
        top3 = sorted(entry.values(), key=lambda item: item.rank)[:3]
        assert alternatives == pytest.approx({item.decoded_token: item.logprob for item in top3}, abs=1e-5)
        assert max(alternatives.values()) == pytest.approx(logprobs.token_logprobs[position])  # greedy


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_as_offline_prompt_logprobs(client, tiny_server, tiny_offline, stream):
    response = client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=4, temperature=0,
                                         logprobs=2, echo=True, stream=stream)
    chunks = list(response) if stream else [response]
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    tokens, token_logprobs = [], []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            token_logprobs += chunk.choices[0].logprobs.token_logprobs
    expected = tiny_offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=2,
                                                            prompt_logprobs=2))[0]
    prompt_ids = expected.prompt_token_ids
    assert text == PROMPT + expected.outputs[0].text
    assert len(tokens) == len(prompt_ids) + 4
    assert token_logprobs[0] is None, "nothing scores the first prompt token"
    for position in range(1, len(prompt_ids)):
        entry = expected.prompt_logprobs[position][prompt_ids[position]]
        assert token_logprobs[position] == pytest.approx(entry.logprob, abs=1e-5)
    generated = expected.outputs[0]
    for offset, (token_id, entry) in enumerate(zip(generated.token_ids, generated.logprobs, strict=True)):
        assert token_logprobs[len(prompt_ids) + offset] == pytest.approx(entry[token_id].logprob, abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_zero_with_echo_returns_the_scored_prompt_and_nothing_generated(client, tiny_server, tiny_offline,
                                                                                 stream):
    response = client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=0, logprobs=2,
                                         echo=True, stream=stream, stream_options={"include_usage": True} if stream
                                         else None)
    chunks = list(response) if stream else [response]
    choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
    tokens = [token for choice in choices if choice.logprobs for token in choice.logprobs.tokens]
    token_logprobs = [value for choice in choices if choice.logprobs for value in choice.logprobs.token_logprobs]
    expected = tiny_offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    prompt_ids = expected.prompt_token_ids
    assert "".join(choice.text for choice in choices) == PROMPT == "".join(tokens)
    assert [choice.finish_reason for choice in choices if choice.finish_reason] == ["length"]
    assert len(token_logprobs) == len(prompt_ids) and token_logprobs[0] is None
    for position in range(1, len(prompt_ids)):
        entry = expected.prompt_logprobs[position][prompt_ids[position]]
        assert token_logprobs[position] == pytest.approx(entry.logprob, abs=1e-5)
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 0)

    plain = client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=0, n=2, temperature=1.0)
    assert [(choice.text, choice.finish_reason) for choice in plain.choices] == [("", "length")] * 2
    assert plain.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=0,
                                  extra_body={"min_tokens": 1})


def test_chat_logprobs(client, tiny_server):
    response = client.chat.completions.create(model=tiny_server.model, messages=MESSAGES, max_tokens=5,
                                              temperature=0, logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 5
    assert "".join(item.token for item in content) == response.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy takes the most likely
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token


def test_models_and_error_statuses(client, tiny_server):
    models = client.models.list().data
    assert [model.id for model in models] == [tiny_server.model]
    assert models[0].model_extra["max_model_len"] == TINY_MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert raised.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=tiny_server.model, prompt="hi", max_tokens=900)
    assert f"{TINY_MAX_MODEL_LEN} tokens" in raised.value.message and "900 for the completion" in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=tiny_server.model, messages=MESSAGES, temperature=-1)
    assert raised.value.body["param"] == "temperature"


def test_stop_string_streamed_and_not_equals_offline(client, tiny_server, tiny_offline):
    free_text = tiny_offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
    stop = free_text[len(free_text) // 2:len(free_text) // 2 + 4]  # occurs mid-output, may span tokens
    expected = tiny_offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0].outputs[0]
    assert expected.finish_reason == "stop" and stop not in expected.text

    response = client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=20, temperature=0,
                                         stop=[stop])
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model=tiny_server.model, prompt=PROMPT, max_tokens=20, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected.text  # nothing past the stop leaked
    assert chunks[-1].choices[0].finish_reason == "stop"
