"""LoRA adapters over HTTP with the official `openai` client: the `model` field picks the adapter, /v1/models
lists them, /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time; adapters the artifact
cannot serve are a 400 naming the field. The reference is the engine in-process under the same adapter (whose
equality with Hugging Face's merged model tests/runtime/test_lora.py checks)."""

from __future__ import annotations

import httpx
import openai
import pytest

from octavo.runtime.sampling_params import SamplingParams
from tests.runtime.engine_helpers import make_engine, run_to_completion
from tests.serve.server_process import running_server

PROMPT = [31, 414, 2768, 314, 99, 5012]


@pytest.fixture(scope="module")
def server(tiny_lora_artifact, tmp_path_factory):
    with running_server(tiny_lora_artifact, tmp_path_factory.mktemp("serve-lora"), "--num-kv-blocks", "64",
                        "--max-model-len", "128", "--max-loras", "3") as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_lora_artifact, lora_adapters):
    engine = make_engine(tiny_lora_artifact, num_kv_blocks=64, lora_modules=(f"c={lora_adapters['c']}",))
    outputs = {}
    for name in (None, "a", "b", "c"):
        engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           request_id=str(name), lora=name)
    for request_id, output in run_to_completion(engine).items():
        outputs[None if request_id == "None" else request_id] = output.outputs[0].token_ids
    return outputs


def reply_text(server, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return response.json()["choices"][0]["text"]


def test_the_model_field_picks_the_adapter_and_models_lists_them(client, server, offline, tiny_lora_artifact):
    from tests.serve.conftest import artifact_tokenizer

    tokenizer = artifact_tokenizer(tiny_lora_artifact)
    for model, name in ((server.model, None), ("a", "a"), ("b", "b")):
        assert reply_text(server, model) == tokenizer.decode(offline[name]), model
    assert reply_text(server, "a") != reply_text(server, "b")
    models = {card.id: card for card in client.models.list().data}
    assert set(models) == {server.model, "a", "b"}
    assert models["a"].model_dump()["parent"] == server.model
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt="hi", max_tokens=2)


def test_adapters_loaded_and_unloaded_at_run_time(client, server, offline, lora_adapters, tiny_lora_artifact):
    from tests.serve.conftest import artifact_tokenizer

    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=60,
                        json={"lora_name": "c", "lora_path": str(lora_adapters["c"])})
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert reply_text(server, "c") == artifact_tokenizer(tiny_lora_artifact).decode(offline["c"])
    assert "c" in {card.id for card in client.models.list().data}
    refused = [({"lora_name": "w", "lora_path": str(lora_adapters["wide"])}, "lora_path", "above this artifact"),
               ({"lora_name": "x", "lora_path": "/no/such/adapter"}, "lora_path", "no adapter_config.json"),
               ({"lora_name": "a", "lora_path": str(lora_adapters["c"])}, "lora_name", "already loaded"),
               ({"lora_name": "d", "lora_path": str(lora_adapters["c"])}, "lora_path", "slots are in use")]
    for body, param, message in refused:
        response = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"], error
    unloaded = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    again = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert "c" not in {card.id for card in client.models.list().data}
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
