"""The command line's quantization options: compile --quant / --kv-cache-dtype, inspect's report."""

from __future__ import annotations

from octavo.compiler import compile_model
from octavo.config import CompileConfig
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
