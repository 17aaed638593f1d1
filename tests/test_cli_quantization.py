"""The command line's quantization options: compile --quant / --kv-cache-dtype, inspect's report."""

from __future__ import annotations

import torch

from octavo.commands.inspect_command import measure_loaded_memory
from octavo.compiler import compile_model
from octavo.config import CompileConfig
from octavo.runtime.weights import load_safetensors_mmap
from tests.conftest import run_cli


def test_inspect_names_the_calibration_of_a_calibrated_artifact(tiny_model_dir, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("A short calibration text: the float model runs on it once. " * 8)
    artifact = compile_model(tiny_model_dir("llama"), tmp_path / "artifact",
                             CompileConfig(dtype="float32", quant="w4-gptq", group_size=16, gptq_act_order=True,
                                           calibration=str(text)))
    result = run_cli("inspect", str(artifact))
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("quant    w4-gptq"))
    assert line.startswith("quant    w4-gptq: w4 weights, group 16, values 8 gptq, 2 rtn; calibration ")
    assert f"calibration {text} text (" in line and " tokens, sha256 " in line


def test_inspect_reports_the_quantization(tiny_quantized_artifact):
    result = run_cli("inspect", str(tiny_quantized_artifact("llama", quant="w4", kv_cache_dtype="int8")))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("quant    w4: w4 weights, group 32, values 10 rtn") for line in lines), result.stdout
    assert "lm_head_weight: w8 group 64 (rtn)" in result.stdout  # the vocabulary projection: one scale per row
    assert "float: norm weights, biases, rotary table" in result.stdout
    assert "kv quant int8 cache, one float32 scale per token and kv head" in result.stdout
    assert "+ 8 cache pools" in result.stdout  # 2 layers x (key, value, key scales, value scales)


def test_compile_w8a8_and_inspect_its_activations(tiny_model_dir, tmp_path):
    artifact = tmp_path / "artifact"
    result = run_cli("compile", str(tiny_model_dir("llama")), "-o", str(artifact), "--quant", "w8a8")
    assert result.returncode == 0, result.stderr
    result = run_cli("inspect", str(artifact))
    assert result.returncode == 0, result.stderr
    assert "quant    w8a8: w8 weights, group per channel, values 10 rtn" in result.stdout
    assert ("activations rounded to int8 at run time (groups of 64 columns of a row, dynamic, symmetric), except "
            "the linear that produces the logits") in result.stdout
    refused = run_cli("compile", str(tiny_model_dir("llama")), "-o", str(tmp_path / "other"), "--quant", "w8a8",
                      "--group-size", "32")
    assert refused.returncode != 0 and "--quant w8a8 takes one scale per output channel" in refused.stderr


def _held(stdout: str) -> dict[str, float]:
    """{dtype: MiB} of `inspect --memory`'s "weights held by the kernels" line."""
    line = next(line for line in stdout.splitlines() if line.startswith("memory   loaded here"))
    listed = line.split("MiB (", 1)[1].rstrip(")")
    return {dtype: float(size) for dtype, size in (item.split() for item in listed.split(", "))}


def _stored_mib(artifact, dtype: torch.dtype) -> float:
    tensors = load_safetensors_mmap(artifact / "weights.safetensors")
    return sum(tensor.nbytes for tensor in tensors.values() if tensor.dtype == dtype) / 2**20


def test_inspect_memory_reports_what_the_loaded_kernels_hold(tiny_quantized_artifact):
    """fp8 weights stay float8 in memory on the cpu backend (its kernels widen them tile by tile); the torch
    backend widens them at load, to bfloat16 or float32: at least twice their bytes."""
    artifact = tiny_quantized_artifact("llama", quant="fp8")
    stored = _stored_mib(artifact, torch.float8_e4m3fn)
    assert stored > 0
    native = run_cli("inspect", str(artifact), "--memory", "--backend", "cpu", "--executor", "eager")
    assert native.returncode == 0, native.stderr
    assert "(cpu backend, eager executor)" in native.stdout and "resident memory " in native.stdout
    held = _held(native.stdout)
    assert abs(held["float8_e4m3fn"] - stored) <= 0.1 + 0.01 * stored
    widened = measure_loaded_memory(artifact, "torch", "eager")
    assert (widened["backend"], widened["executor"]) == ("torch", "eager")
    assert "float8_e4m3fn" not in widened["weights"]
    widened_mib = (widened["weights"].get("bfloat16", 0) + widened["weights"].get("float32", 0)) / 2**20
    assert widened_mib >= held.get("float32", 0) + 2 * stored - 0.2
