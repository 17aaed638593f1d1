"""vLLM's /tokenize, /detokenize and /version on `octavo serve` of the tiny llama (the bundled model's real tokenizer).

The reference is the tokenizer itself: `encode` for a prompt, `apply_chat_template` for messages, `decode`.
"""

from __future__ import annotations

import httpx
from transformers import AutoTokenizer

from octavo import __version__
from octavo.ir.artifact_format import TOKENIZER_DIR
from tests.serve.conftest import TINY_MAX_MODEL_LEN

TEXT = "Tokenizers split text into pieces: naïve café, 東京, emoji 🙂."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_tokenize_and_detokenize_round_trip_against_the_tokenizer(tiny_server, tiny_llama_artifact):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_artifact / TOKENIZER_DIR, local_files_only=True)
    for add_special_tokens in (True, False):
        response = post(tiny_server, "/tokenize", {"model": tiny_server.model, "prompt": TEXT,
                                                   "add_special_tokens": add_special_tokens,
                                                   "return_token_strs": True})
        assert response.status_code == 200, response.text
        expected = tokenizer.encode(TEXT, add_special_tokens=add_special_tokens)
        assert response.json() == {"count": len(expected), "max_model_len": TINY_MAX_MODEL_LEN, "tokens": expected,
                                   "token_strs": tokenizer.convert_ids_to_tokens(expected)}
        detokenized = post(tiny_server, "/detokenize", {"model": tiny_server.model, "tokens": expected})
        assert detokenized.status_code == 200 and detokenized.json() == {"prompt": tokenizer.decode(expected)}
    assert post(tiny_server, "/detokenize", {"tokens": tokenizer.encode(TEXT, add_special_tokens=False)}
                ).json()["prompt"] == TEXT

    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    chat = post(tiny_server, "/tokenize", {"messages": MESSAGES}).json()
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert chat["token_strs"] is None
    completion = post(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == chat["count"]
    closed = post(tiny_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert closed["tokens"] == tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False), add_special_tokens=False)
    assert len(closed["tokens"]) < chat["count"]


def test_tokenizer_endpoints_reject_bad_input_naming_the_field(tiny_server):
    for path, body, param in [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
         "continue_final_message"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens.1"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens.1"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ]:
        response = post(tiny_server, path, body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.text)
    assert post(tiny_server, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404
    # An unknown field is ignored (and logged), as on the completion endpoints.
    ignored = post(tiny_server, "/tokenize", {"prompt": "x", "unknown": 1})
    assert ignored.status_code == 200 and ignored.json() == post(tiny_server, "/tokenize", {"prompt": "x"}).json()
    assert httpx.post(f"{tiny_server.url}/tokenize", content=b"[1]", timeout=10,
                      headers={"content-type": "application/json"}).status_code == 400


def test_version(tiny_server):
    response = httpx.get(f"{tiny_server.url}/version", timeout=10)
    assert response.status_code == 200 and response.json() == {"version": __version__}
