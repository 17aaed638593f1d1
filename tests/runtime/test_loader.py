"""Artifact loading: verification errors (checksum, version, missing files), mmap'd weights, no code run."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from octavo.config import EngineConfig
from octavo.errors import ArtifactError
from octavo.ir.artifact_format import FORMAT_VERSION
from octavo.runtime.engine import LLMEngine
from octavo.runtime.loader import load_artifact, read_manifest
from tests.conftest import assert_pool_full
from tests.runtime.test_weights import mapped_files


@pytest.fixture
def artifact_copy(tiny_artifact, tmp_path) -> Path:
    """A private copy of the tiny llama artifact that a test may damage."""
    return Path(shutil.copytree(tiny_artifact("llama"), tmp_path / "artifact"))


def flip_byte(path: Path, offset_fraction: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    index = int(len(data) * offset_fraction)
    data[index] ^= 0x01
    path.write_bytes(bytes(data))


def edit_manifest(root: Path, change) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    change(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def load_error(path: Path) -> str:
    with pytest.raises(ArtifactError) as caught:
        load_artifact(path)
    message = str(caught.value)
    assert "\n" not in message, "errors are one line"
    return message


@pytest.mark.parametrize("relative", ["weights.safetensors", "graph.onnx", "tokenizer/tokenizer.json"])
def test_corrupted_file_is_a_checksum_error_naming_the_file(artifact_copy, relative):
    flip_byte(artifact_copy / relative)
    message = load_error(artifact_copy)
    assert message.startswith(f"checksum mismatch for {artifact_copy / relative}:"), message


def test_without_verification_a_corrupted_file_loads(artifact_copy):
    # verify=False is the documented way to skip the checksums (a flipped bit in a weight is still a model).
    flip_byte(artifact_copy / "weights.safetensors", 0.9)
    loaded = load_artifact(artifact_copy, verify=False)
    assert loaded.weights


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 0, None])
def test_other_format_version_names_both_versions(artifact_copy, version):
    edit_manifest(artifact_copy, lambda manifest: manifest.update(format_version=version))
    message = load_error(artifact_copy)
    assert f"has format version {version};" in message
    assert f"this Octavo reads version {FORMAT_VERSION}" in message
    assert "recompile" in message


@pytest.mark.parametrize("relative", ["weights.safetensors", "graph.onnx", "tokenizer/tokenizer_config.json"])
def test_missing_file_is_named(artifact_copy, relative):
    (artifact_copy / relative).unlink()
    assert load_error(artifact_copy) == f"artifact {artifact_copy} is missing {relative}"


def test_manifest_that_does_not_list_the_weights(artifact_copy):
    edit_manifest(artifact_copy, lambda manifest: manifest["files"].pop("weights.safetensors"))
    assert "does not list weights.safetensors" in load_error(artifact_copy)


def test_directory_without_a_manifest_is_not_an_artifact(tmp_path, tiny_model_dir):
    for path in (tmp_path, tiny_model_dir("llama")):
        message = load_error(path)
        assert message.startswith(f"{path} is not an Octavo artifact (no manifest.json)")


def test_missing_directory(tmp_path):
    assert load_error(tmp_path / "nowhere") == f"no such artifact directory: {tmp_path / 'nowhere'}"


def test_manifest_that_is_not_json(artifact_copy):
    (artifact_copy / "manifest.json").write_text("{ truncated")
    assert "manifest.json is not valid JSON" in load_error(artifact_copy)


def test_read_manifest_checks_only_the_manifest(artifact_copy):
    flip_byte(artifact_copy / "weights.safetensors")
    manifest = read_manifest(artifact_copy)
    assert manifest["format_version"] == FORMAT_VERSION
    assert set(manifest["files"]) >= {"graph.onnx", "weights.safetensors", "tokenizer/tokenizer.json"}


def test_kernel_sources_in_the_artifact_are_never_imported(artifact_copy, tmp_path):
    marker = tmp_path / "executed"
    source = f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit('artifact code was executed')\n"
    kernel = artifact_copy / "kernels" / "evil.py"
    kernel.write_text(source)
    digest = hashlib.sha256(source.encode()).hexdigest()
    edit_manifest(artifact_copy, lambda manifest: manifest["files"].update({"kernels/evil.py": digest}))
    engine = LLMEngine(load_artifact(artifact_copy), EngineConfig(num_kv_blocks=4))
    engine.add_request([5, 6, 7])
    while engine.has_unfinished_requests():
        engine.step()
    assert not marker.exists()
    assert_pool_full(engine)


def test_weights_are_memory_mapped_and_bound_without_copies(tiny_artifact):
    root = tiny_artifact("llama")
    loaded = load_artifact(root)
    expected = load_file(root / "weights.safetensors")
    assert sorted(loaded.weights) == sorted(expected)
    for name, tensor in loaded.weights.items():
        assert torch.equal(tensor, expected[name]), name
        assert str(root / "weights.safetensors") in mapped_files(tensor.data_ptr()), name
    pointers = {name: tensor.data_ptr() for name, tensor in loaded.weights.items()}
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=4, device="cpu"))
    buffers = dict(engine.executor.graph_module.named_buffers())
    assert set(buffers) == set(pointers)
    for name, buffer in buffers.items():
        assert buffer.data_ptr() == pointers[name], f"{name} was copied when bound to the graph"


def test_loaded_artifact_describes_itself(tiny_artifact, smollm2_source):
    loaded = load_artifact(tiny_artifact("llama"))
    assert loaded.eos_token_ids == [2]
    assert loaded.kv_layout["num_layers"] == 2 and loaded.kv_layout["num_kv_heads"] == 2
    # The artifact's tokenizer is the one the tiny model ships (the bundled model's): same ids, same template.
    source = smollm2_source.tokenizer
    text = "Hello world, what is 17 x 23? <|im_start|>"
    assert loaded.tokenizer.encode(text) == source.encode(text) and len(source.encode(text)) > 5
    assert loaded.tokenizer.chat_template == source.chat_template is not None
    placeholders = [node.name for node in loaded.graph_module.graph.nodes if node.op == "placeholder"]
    assert set(loaded.weights) <= set(placeholders)
    assert {"input_ids", "positions", "slot_mapping"} <= set(placeholders)
