"""Property-based fuzzing of request bodies: no 500, no hang, every rejection a 4xx OpenAI error with a message.

Bodies are valid requests with fields replaced by values of every JSON type (in range, out of range,
wrong type), required fields dropped, unknown fields added, and raw bodies that are not JSON objects.
The counts of requests and statuses are printed (run with -s to see them).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.server_process import scrape_metrics

# The default run is derandomized (same bodies, same counts every time); OCTAVO_FUZZ_EXAMPLES=N runs N random ones.
MAX_EXAMPLES = int(os.environ.get("OCTAVO_FUZZ_EXAMPLES", "250"))
DERANDOMIZE = "OCTAVO_FUZZ_EXAMPLES" not in os.environ
REQUEST_TIMEOUT_S = 60.0  # a request that takes longer is a hang

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=6)
small_counts = st.integers(min_value=-2, max_value=6)
probabilities = st.floats(min_value=-0.5, max_value=1.5)
penalties = st.floats(min_value=-3, max_value=3)
texts = st.text(max_size=24)

SHARED_FIELDS = {
    "model": st.sampled_from(["test-model", "unknown-model"]) | json_values,
    "n": st.one_of(st.integers(min_value=-1, max_value=3), st.integers(min_value=129), json_values),
    "max_tokens": st.one_of(small_counts, st.integers(), json_values),
    "temperature": st.one_of(st.floats(min_value=-1, max_value=3), st.just(0), json_values),
    "top_p": probabilities | json_values,
    "top_k": st.one_of(st.integers(min_value=-3, max_value=60000), json_values),
    "min_p": probabilities | json_values,
    "presence_penalty": penalties | json_values,
    "frequency_penalty": penalties | json_values,
    "repetition_penalty": st.floats(min_value=-1, max_value=3) | json_values,
    "stop": st.one_of(texts, st.lists(texts, max_size=3), json_values),
    "stop_token_ids": st.lists(st.integers(min_value=-5, max_value=60000), max_size=3) | json_values,
    "seed": st.integers() | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "logit_bias": st.dictionaries(st.integers(-5, 60000).map(str) | texts, st.floats(-200, 200), max_size=3)
    | json_values,
    "ignore_eos": st.booleans() | json_values,
    "min_tokens": small_counts | json_values,
    "user": texts | json_values,
    "unknown_field": json_values,
}
COMPLETION_FIELDS = {
    **SHARED_FIELDS,
    "prompt": st.one_of(texts, st.lists(st.integers(min_value=-10, max_value=60000), max_size=12),
                        st.lists(texts, max_size=3),
                        st.lists(st.lists(st.integers(min_value=-5, max_value=50000), max_size=5), max_size=3),
                        json_values),
    "logprobs": st.integers(min_value=-1, max_value=25) | json_values,
    "echo": st.booleans() | json_values,
    "suffix": texts | json_values,
}
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]) | json_values},
    optional={"content": st.one_of(texts, st.none(), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": texts}), max_size=2), json_values),
              "name": texts | json_values}), max_size=3)
CHAT_FIELDS = {
    **SHARED_FIELDS,
    "messages": messages | json_values,
    "max_completion_tokens": st.one_of(small_counts, st.integers(), json_values),
    "logprobs": st.booleans() | json_values,
    "top_logprobs": st.integers(min_value=-1, max_value=25) | json_values,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}) | json_values,
}
BASES = {
    "/v1/completions": ({"model": "test-model", "prompt": "Hello", "max_tokens": 4}, COMPLETION_FIELDS, "prompt"),
    "/v1/chat/completions": ({"model": "test-model", "messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 4}, CHAT_FIELDS, "messages"),
}


@st.composite
def request_bodies(draw) -> tuple[str, bytes]:
    """(endpoint, raw body): usually a valid body with up to 4 fields changed, sometimes no JSON object at all."""
    endpoint = draw(st.sampled_from(sorted(BASES)))
    base, fields, required = BASES[endpoint]
    kind = draw(st.sampled_from(["mutated"] * 8 + ["not_an_object", "not_json"]))
    if kind == "not_json":
        return endpoint, draw(st.binary(max_size=40) | st.text(max_size=40).map(str.encode))
    if kind == "not_an_object":
        return endpoint, json.dumps(draw(json_values)).encode()
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.integers(0, 9)) == 0:
        del body[required]
    return endpoint, json.dumps(body).encode()


def check_response(response: httpx.Response, body: bytes) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500], body[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert 400 <= response.status_code < 500 and isinstance(error["message"], str) and error["message"]
        assert error["type"]
        return
    assert response.status_code == 200
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        payload = response.json()
        assert payload["choices"] and payload["usage"]["completion_tokens"] >= len(payload["choices"])


def test_fuzzed_request_bodies_never_500_or_hang(tiny_server):
    statuses: Counter[int] = Counter()

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=DERANDOMIZE, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request_bodies())
    def send(request: tuple[str, bytes]) -> None:
        endpoint, body = request
        with httpx.Client(base_url=tiny_server.url, timeout=REQUEST_TIMEOUT_S) as client:
            response = client.post(endpoint, content=body, headers={"content-type": "application/json"})
        statuses[response.status_code] += 1
        check_response(response, body)

    send()
    total = sum(statuses.values())
    print(f"\nfuzzing: {total} requests sent, statuses {dict(sorted(statuses.items()))}")
    assert statuses[400] > 0 and statuses[200] > 0
    assert httpx.get(f"{tiny_server.url}/health", timeout=5).status_code == 200
    metrics = scrape_metrics(tiny_server.url)
    assert metrics["octavo_num_requests_running"] == metrics["octavo_num_requests_waiting"] == 0
    assert metrics["octavo_kv_blocks_used"] == 0  # every block free or merely cached
