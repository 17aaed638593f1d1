"""The compile cache: one artifact per (model checksum, output-deciding options, versions), reused as is."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers

import octavo
from octavo.codegen.cpu_backend.precision import resolve_precision, slow_dtype_warning
from octavo.compile_cache import cache_key, cached_artifact
from octavo.config import CompileConfig, EngineConfig
from octavo.errors import OctavoError
from octavo.frontend.sources import load_model
from octavo.llm import LLM
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(path: Path) -> dict[str, int]:
    """Modification time and inode of every file of an artifact (a recompile replaces them all)."""
    return {str(file.relative_to(path)): (file.stat().st_mtime_ns, file.stat().st_ino)
            for file in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    """One cache directory for the module, so that later tests find what earlier ones compiled."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def cache_dir(shared_cache, monkeypatch) -> Path:
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(shared_cache))
    return shared_cache


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def model_checksum(directory: Path) -> str:
    """The documented checksum of an HF directory: sha256 over config.json, then every *.safetensors in name
    order, each as its file name followed by its bytes."""
    digest = hashlib.sha256()
    for file in [directory / "config.json", *sorted(directory.glob("*.safetensors"))]:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def documented_key(checksum: str, options: dict) -> str:
    """The documented cache key: the first 16 hex digits of sha256 over the JSON (sorted keys) of the model
    checksum, the output-deciding options and the octavo, torch and transformers versions."""
    payload = {"model": checksum, "options": options, "octavo": octavo.__version__, "torch": torch.__version__,
               "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def test_same_model_and_options_reuse_one_artifact(cache_dir, model_dir):
    first = cached_artifact(model_dir, CompileConfig(dtype="float32"))
    checksum = model_checksum(model_dir)
    options = {"dtype": "float32", "block_size": 16, "disabled_passes": [], "stop_after": None}
    assert first == cache_dir / f"{model_dir.name}-float32-{documented_key(checksum, options)}"
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["source"]["checksum_sha256"] == checksum
    assert manifest["compile_options"] == options
    before, entries = snapshot(first), sorted(cache_dir.iterdir())
    # Options that only change what is written for reading (dumps, progress) are not part of the key.
    again = cached_artifact(model_dir, CompileConfig(dtype="float32", progress=True))
    assert again == first
    assert snapshot(again) == before, "the cached artifact was recompiled"
    assert sorted(cache_dir.iterdir()) == entries, "nothing new was compiled"
    # LLM(model source) goes through the same cache.
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=8)
    assert llm.artifact_path == first
    assert snapshot(first) == before
    [output] = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 3
    assert_pool_full(llm.engine)


def test_changing_the_dtype_gives_another_artifact(cache_dir, model_dir, caplog):
    float32 = cached_artifact(model_dir, CompileConfig(dtype="float32"))
    before = snapshot(float32)
    bfloat16 = cached_artifact(model_dir, CompileConfig(dtype="bfloat16"))
    assert bfloat16 != float32
    assert snapshot(float32) == before, "compiling another dtype left the float32 entry alone"
    assert bfloat16.name.startswith(f"{model_dir.name}-bfloat16-")
    assert json.loads((bfloat16 / "manifest.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((float32 / "manifest.json").read_text())["dtype"] == "float32"
    weights = json.loads((bfloat16 / "manifest.json").read_text())["signature"]
    assert weights["weight_bytes"] < json.loads((float32 / "manifest.json").read_text())["signature"]["weight_bytes"]
    # Loading it warns exactly where bf16 compute is slow (neither AMX nor AVX512_BF16), saying how to fix it.
    with caplog.at_level(logging.WARNING, logger="octavo"):
        LLMEngine(bfloat16, EngineConfig(num_kv_blocks=8))
    expected = slow_dtype_warning("bfloat16")
    warnings = [record.getMessage() for record in caplog.records if "no fast matmul" in record.getMessage()]
    assert warnings == ([expected] if expected else [])


def test_auto_is_keyed_and_recorded_as_the_machine_choice(model_dir):
    source = load_model(model_dir)
    resolved = resolve_precision(CompileConfig())
    assert cache_key(source, CompileConfig()) == cache_key(source, resolved)
    # auto is the artifact of the machine's choice: the same entry as asking for that choice explicitly.
    explicit = CompileConfig(dtype=resolved.dtype, weight_dtype=resolved.weight_dtype)
    assert cache_key(source, CompileConfig()) == cache_key(source, explicit)
    plain = resolved.dtype == "float32" and resolved.storage_dtype == "float32"
    assert (cache_key(source, CompileConfig()) == cache_key(source, CompileConfig(dtype="float32"))) == plain
    assert cache_key(source, CompileConfig(dtype="float32", weight_dtype="bfloat16")) != cache_key(
        source, CompileConfig(dtype="float32"))


def test_the_key_follows_the_model_checksum_not_its_location(tmp_path, model_dir):
    config = CompileConfig()
    original = cache_key(load_model(model_dir), config)
    copy = Path(shutil.copytree(model_dir, tmp_path / "elsewhere" / model_dir.name))
    assert cache_key(load_model(copy), config) == original, "an identical copy must hit the same entry"
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert cache_key(load_model(copy), config) != original
    shutil.copy(model_dir / "model.safetensors", weights)
    config_json = json.loads((copy / "config.json").read_text())
    config_json["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(config_json))
    assert cache_key(load_model(copy), config) != original


def test_the_key_follows_the_output_deciding_options_only(model_dir, tmp_path):
    source = load_model(model_dir)
    base = cache_key(source, CompileConfig())
    assert cache_key(source, CompileConfig(block_size=32)) != base
    assert cache_key(source, CompileConfig(disabled_passes=("prune_logits",))) != base
    assert cache_key(source, CompileConfig(dtype="float16")) != base
    assert cache_key(source, CompileConfig(dump_dir=str(tmp_path), progress=True,
                                           print_ir_after=("prune_logits",))) == base
    assert cache_key(source, CompileConfig(disabled_passes=("a", "b"))) == cache_key(
        source, CompileConfig(disabled_passes=("b", "a")))


def test_the_key_follows_the_quantization_options_and_the_calibration_text(model_dir, tmp_path):
    source = load_model(model_dir)
    options = [{}, {"quant": "w8"}, {"quant": "w4"}, {"quant": "w4", "group_size": 64}, {"quant": "fp8"},
               {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8"}, {"calibration": "default"}]
    assert len({cache_key(source, CompileConfig(**option)) for option in options}) == len(options)
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("calibration text")
    second.write_text("calibration text")
    key = cache_key(source, CompileConfig(calibration=str(first)))
    assert cache_key(source, CompileConfig(calibration=str(second))) == key, "the contents decide, not the name"
    second.write_text("other text")
    assert cache_key(source, CompileConfig(calibration=str(second))) != key
    with pytest.raises(OctavoError, match="does not exist"):
        CompileConfig(quant="w4", calibration=str(tmp_path / "missing.txt"))
