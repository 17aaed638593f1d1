"""The official `openai` client against `octavo serve` of the real SmolLM2: greedy results equal LLM.generate.

Requests go one at a time, as the offline references are made, so both sides batch alike.
"""

from __future__ import annotations

import openai
import pytest

from octavo.llm import LLM
from octavo.runtime.sampling_params import SamplingParams
from tests.serve.server_process import running_server

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(smollm2_fp32_artifact, tmp_path_factory):
    with running_server(smollm2_fp32_artifact, tmp_path_factory.mktemp("serve-smollm2"),
                        "--num-kv-blocks", "64") as server:
        yield server


@pytest.fixture(scope="module")
def offline(smollm2_fp32_artifact) -> LLM:
    return LLM(smollm2_fp32_artifact, num_kv_blocks=64)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_completions_greedy_equal_offline_streamed_and_not(client, server, offline):
    expected = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
    reference = expected.outputs[0]

    response = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == reference.text
    assert response.choices[0].finish_reason == reference.finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(reference.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens

    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text_chunks = [chunk for chunk in chunks if chunk.choices]
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == reference.text
    assert text_chunks[-1].choices[0].finish_reason == reference.finish_reason
    assert all(chunk.choices[0].finish_reason is None for chunk in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == response.usage


def test_chat_greedy_equals_offline_streamed_and_not(client, server, offline):
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
    reference = expected.outputs[0]

    response = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                              temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == reference.text
    assert response.choices[0].finish_reason == reference.finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(reference.token_ids)

    chunks = list(client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=0,
                                                 max_completion_tokens=MAX_TOKENS, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == reference.text
    assert chunks[-1].choices[0].finish_reason == reference.finish_reason
