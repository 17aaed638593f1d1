"""vLLM's `add_special_tokens` on `octavo serve`: the prompt's token count against the tokenizer's own `encode`.

The tiny llama ships here with a tokenizer that puts a BOS token before every text it encodes with its
special tokens (the bundled model's adds none, so both settings would encode alike). Completions add the
special tokens by default, chat completions do not (the chat template writes its own), as in vLLM.
"""

from __future__ import annotations

import httpx
import pytest
from tokenizers import Tokenizer, processors

from tests.serve.conftest import artifact_tokenizer
from tests.serve.server_process import running_small_server

BOS = "<|endoftext|>"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def bos_artifact(tiny_llama_variant):
    def with_bos(source):
        tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
        tokenizer.save(str(source / "tokenizer.json"))

    return tiny_llama_variant("bos", with_bos)


@pytest.fixture(scope="module")
def tokenizer(bos_artifact):
    return artifact_tokenizer(bos_artifact)


@pytest.fixture(scope="module")
def server(bos_artifact, tmp_path_factory):
    with running_small_server(bos_artifact, tmp_path_factory.mktemp("serve-bos")) as server:
        yield server


def prompt_tokens(server, path: str, **fields) -> int:
    response = httpx.post(f"{server.url}{path}", timeout=60,
                          json={"model": server.model, "max_tokens": 2, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_completions_add_special_tokens_by_default(server, tokenizer):
    with_bos, without = (len(tokenizer.encode(PROMPT, add_special_tokens=flag)) for flag in (True, False))
    assert with_bos == without + 1  # the tokenizer built above adds its BOS
    assert prompt_tokens(server, "/v1/completions", prompt=PROMPT) == with_bos
    assert prompt_tokens(server, "/v1/completions", prompt=PROMPT, add_special_tokens=True) == with_bos
    assert prompt_tokens(server, "/v1/completions", prompt=PROMPT, add_special_tokens=False) == without


def test_chat_adds_special_tokens_only_when_asked(server, tokenizer):
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    with_bos, without = (len(tokenizer.encode(rendered, add_special_tokens=flag)) for flag in (True, False))
    assert with_bos == without + 1
    assert prompt_tokens(server, "/v1/chat/completions", messages=MESSAGES) == without
    assert prompt_tokens(server, "/v1/chat/completions", messages=MESSAGES, add_special_tokens=False) == without
    assert prompt_tokens(server, "/v1/chat/completions", messages=MESSAGES, add_special_tokens=True) == with_bos
