"""The command line's quantization options: compile --quant / --kv-cache-dtype, inspect's report."""

from __future__ import annotations

from tests.conftest import run_cli


def test_calibrated_schemes_say_they_are_not_available_yet(tmp_path):
    result = run_cli("compile", "smollm2-135m", "-o", str(tmp_path / "artifact"), "--quant", "w4-gptq")
    assert result.returncode == 1
    assert "--quant w4-gptq is not yet available" in result.stderr
    assert not (tmp_path / "artifact").exists()


def test_inspect_reports_the_quantization(tiny_quantized_artifact):
    result = run_cli("inspect", str(tiny_quantized_artifact("llama", quant="w4", kv_cache_dtype="int8")))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("quant    w4: w4 weights, group 32, values 10 rtn") for line in lines), result.stdout
    assert "lm_head_weight: w8 group 64 (rtn)" in result.stdout  # the vocabulary projection: one scale per row
    assert "float: norm weights, biases, rotary table" in result.stdout
    assert "kv quant int8 cache, one float32 scale per token and kv head" in result.stdout
    assert "+ 8 cache pools" in result.stdout  # 2 layers x (key, value, key scales, value scales)
