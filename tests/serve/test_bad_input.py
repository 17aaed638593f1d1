"""Bad input to `octavo serve` of the tiny llama: invalid Unicode, numbers out of range, oversized bodies and prompts.

Bodies are written as raw JSON text, so that a lone surrogate travels as the escape "\\ud800" (as a
client that builds JSON by hand would send it), and numbers as the literal the test means.
"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from octavo.serve.context import DEFAULT_MAX_REQUEST_BYTES
from tests.serve.conftest import TINY_MAX_MODEL_LEN
from tests.serve.server_process import scrape_metrics

COMPLETION = {"model": "test-model", "prompt": "Hello", "max_tokens": 1}
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
LONE = "\ud800"  # json.dumps writes it as the escape \ud800


def post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    raw = json.dumps(body)  # ensure_ascii: every non-ASCII character, surrogates included, as \uXXXX
    return httpx.post(f"{server.url}{path}", content=raw.encode("ascii"), timeout=60,
                      headers={"content-type": "application/json"})


def with_field(base: dict, path: list, value) -> dict:
    body = json.loads(json.dumps(base))
    node = body
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return body


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", with_field(COMPLETION, ["prompt"], f"a{LONE}b"), "prompt"),
    ("/v1/completions", with_field(COMPLETION, ["prompt"], ["fine", f"{LONE}"]), "prompt.1"),
    ("/v1/completions", with_field(COMPLETION, ["stop"], [f"x{LONE}"]), "stop.0"),
    ("/v1/completions", with_field(COMPLETION, ["model"], LONE), "model"),
    ("/v1/completions", with_field(COMPLETION, ["user"], LONE), "user"),
    ("/v1/completions", with_field(COMPLETION, ["metadata"], {"key": LONE}), "metadata.key"),
    ("/v1/completions", with_field(COMPLETION, ["logit_bias"], {LONE: 1}), None),
    ("/v1/completions", with_field(COMPLETION, [LONE], 1), LONE),
    ("/v1/chat/completions", with_field(CHAT, ["messages", 0, "content"], f"hi {LONE}"), "messages.0.content"),
    ("/v1/chat/completions", with_field(CHAT, ["messages", 0, "content"], [{"type": "text", "text": LONE}]),
     "messages.0.content.0.text"),
    ("/v1/chat/completions", with_field(CHAT, ["messages", 0, "name"], LONE), "messages.0.name"),
])
def test_text_that_is_not_unicode_is_400_naming_the_field(tiny_server, path, body, param):
    response = post(tiny_server, body, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "not valid Unicode" in error["message"] and "surrogate" in error["message"]
    if param is not None:
        assert error["param"] == param
    else:
        assert error["param"].startswith("logit_bias.")


OUT_OF_RANGE = [
    ("temperature", 2.0001), ("temperature", -0.5), ("top_p", 0), ("top_p", 1.0001), ("top_k", -2),
    ("min_p", 1.5), ("min_p", -0.1), ("presence_penalty", 2.5), ("presence_penalty", -2.0001),
    ("frequency_penalty", -3), ("frequency_penalty", 2.0001), ("repetition_penalty", 0),
    ("repetition_penalty", 2.5), ("n", 0), ("n", 129), ("logprobs", 21), ("logprobs", -1), ("seed", 2**63),
    ("seed", -(2**63) - 1), ("max_tokens", -1), ("min_tokens", -1), ("stop_token_ids", [-1]),
    ("logit_bias", {"5": 100.5}), ("logit_bias", {"5": -101}), ("logit_bias", {"5": 1e308}),
    ("temperature", 1e308), ("max_tokens", 2**64),
]
IN_RANGE = [
    ("temperature", 2), ("temperature", -0.0), ("top_p", 1), ("top_p", 1e-300), ("top_k", -1),
    ("presence_penalty", -2), ("frequency_penalty", 2), ("repetition_penalty", 2), ("logprobs", 20),
    ("seed", 2**63 - 1), ("seed", -(2**63)), ("logit_bias", {"5": 100, "6": -100}), ("n", 2),
]


def test_numbers_outside_the_documented_ranges_are_400_naming_the_field(tiny_server):
    for field, value in OUT_OF_RANGE:
        response = post(tiny_server, {**COMPLETION, "temperature": 1.0, field: value})
        assert response.status_code == 400, (field, value, response.text)
        assert response.json()["error"]["param"].split(".")[0] == field, (field, value, response.text)
    for field, value in [("top_logprobs", 21), ("max_completion_tokens", 0)]:
        response = post(tiny_server, {**CHAT, "logprobs": True, field: value}, "/v1/chat/completions")
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
    for field, value in IN_RANGE:
        response = post(tiny_server, {**COMPLETION, "temperature": 1.0, field: value})
        assert response.status_code == 200, (field, value, response.text)


def test_json_number_literals_at_the_edges_are_400_not_500(tiny_server):
    for literal in ("NaN", "Infinity", "-Infinity", "1e999", "9" * 5000):
        raw = '{"model": "test-model", "prompt": "Hi", "max_tokens": 1, "temperature": ' + literal + "}"
        response = httpx.post(f"{tiny_server.url}/v1/completions", content=raw, timeout=60,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400, (literal[:20], response.text)
    deep = '{"model": "test-model", "max_tokens": 1, "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = httpx.post(f"{tiny_server.url}/v1/completions", content=deep, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400


def raw_request(server, head: bytes, send_body) -> bytes:
    """Send `head`, then `send_body(sock)` on another thread; the response, read until the server closes."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head)
        sender = threading.Thread(target=send_body, args=(sock,), daemon=True)
        sender.start()
        response = b""
        while chunk := _receive(sock):  # headers and body may come in separate segments
            response += chunk
        sender.join(timeout=60)
        return response


def _receive(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:  # the server closed while the body was still arriving
        return b""


def test_body_over_the_limit_is_413_before_it_is_read(tiny_server):
    declared = 20 * 2**20
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % declared)
    # Only 1 KiB of the declared 20 MiB is ever sent: the answer must come without the rest.
    response = raw_request(tiny_server, head, lambda sock: sock.sendall(b'{"prompt": "' + b"x" * 1024))
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert b"request_too_large" in response and b"--max-request-bytes" in response

    sent = []

    def send_chunks(sock):  # a chunked body (no Content-Length) twice the limit, cut off by the server
        chunk = b"x" * 65536
        try:
            sock.sendall(b'%x\r\n{"prompt": "\r\n' % len(b'{"prompt": "'))
            while sum(sent) < 2 * DEFAULT_MAX_REQUEST_BYTES:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent.append(len(chunk))
        except OSError:
            pass  # the server answered and closed the connection

    head = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    response = raw_request(tiny_server, head, send_chunks)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert sum(sent) < 2 * DEFAULT_MAX_REQUEST_BYTES, "the server read the whole oversized body"
    assert scrape_metrics(tiny_server.url)['octavo_http_requests_total{endpoint="/v1/completions",status="413"}'] >= 2


def test_prompt_whose_characters_cannot_fit_is_refused_and_one_at_the_bound_is_served(tiny_server):
    """The bundled tokenizer's longest token covers 81 characters ("\\n" and 80 spaces)."""
    too_long = "a" * (TINY_MAX_MODEL_LEN * 81)
    response = post(tiny_server, {**COMPLETION, "prompt": too_long, "max_tokens": None})
    assert response.status_code == 400
    assert f"{len(too_long)} characters, so at least {TINY_MAX_MODEL_LEN} tokens" in response.json()["error"]["message"]
    big = post(tiny_server, {**COMPLETION, "prompt": "x" * (7 * 2**20)})  # under the body limit
    assert big.status_code == 400 and "characters" in big.json()["error"]["message"]
    # 100 tokens of 81 characters each: as long in characters as a prompt that fits can be.
    at_the_bound = ("\n" + " " * 80) * 100
    response = post(tiny_server, {**COMPLETION, "prompt": at_the_bound, "max_tokens": 4, "echo": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 100
