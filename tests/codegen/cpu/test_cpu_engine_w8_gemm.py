"""End to end: a bfloat16 model with `--quant w8` / `--quant w4` on the default engine (cpu backend, compiled
executor).

A tiny Llama in bfloat16 with int8 weights (one scale per row), run twice on the compiled executor: as users get
it (prompts of more than 8 tokens take the quantized GEMM, which multiplies the int8 weights as they are against
x's rows as 16-bit integers on CPUs with AMX-INT8) and with OCTAVO_CPU_QUANTIZED_GEMM=amx_bf16 (weights
dequantized to bfloat16 tiles). Both hold the same weights and differ only in how the GEMM rounds x:
tests/codegen/cpu/engine_pairs.py states what must agree. The steps of up to 8 rows likewise: as users get them
(the integer GEMVs: for int8 weights on AMX-INT8 CPUs and up to 5 rows on other AVX512_VNNI ones, for 4-bit weights
in groups of 32 on AVX512_VNNI ones; the bfloat16 GEMV for the other int8 rows from 4 to 8 on AVX512_BF16 CPUs)
against OCTAVO_CPU_W8_GEMV=float / OCTAVO_CPU_W4_GEMV=float.
"""

from __future__ import annotations

import pytest

from octavo.config import CompileConfig
from tests.codegen.cpu.engine_pairs import (
    default_engine_pair,
    largest_logit_difference,
    random_prompts,
    reference_models,
    tiny_llama_d32,
)
from tests.codegen.cpu.test_cpu_linear_quantized import (
    dot_w8_gemv_runs,
    int8_gemm_runs,
    integer_gemv_runs,
    integer_w8_gemv_runs,
)

PROMPT_LENGTHS = [12, 23, 40]  # every prompt above the GEMV's 8 rows
MAX_TOKENS = 8
DECODE_PROMPT_LENGTHS = [5, 9, 17]  # the first prompt's 5 rows also run through the GEMV
DECODE_TOKENS = 12  # up to 3 sequences a decode step: the GEMV's rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    return tiny_llama_d32(tmp_path_factory.mktemp("tiny-llama-w8"), tokenizer_dir)


def test_default_engine_runs_int8_weights_as_the_dequantizing_gemm_does(model_dir, tmp_path, cpu_kernels, one_thread,
                                                                      compiled_cache, monkeypatch):
    default, dequantizing = default_engine_pair(model_dir, tmp_path / "artifact",
                                                CompileConfig(dtype="bfloat16", quant="w8"),
                                                "OCTAVO_CPU_QUANTIZED_GEMM", monkeypatch)

    # The size of one bfloat16 rounding is measured on the float model, which the int8 weights round per row.
    models = reference_models(model_dir)
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    largest_difference = largest_logit_difference(default, dequantizing, "OCTAVO_CPU_QUANTIZED_GEMM", "amx_bf16",
                                                  models, prompts, MAX_TOKENS, monkeypatch)
    # The paths differ exactly where the integer GEMM runs; elsewhere both settings take the same GEMM.
    assert (largest_difference > 0) == int8_gemm_runs(cpu_kernels)

    # Decode rows: the integer GEMV against the float32 one, on the same two engines.
    prompts = random_prompts(DECODE_PROMPT_LENGTHS, seed=6)
    largest_difference = largest_logit_difference(default, dequantizing, "OCTAVO_CPU_W8_GEMV", "float", models,
                                                  prompts, DECODE_TOKENS, monkeypatch)
    # They differ where the integer GEMV runs (the decode steps' 1 to 3 rows take it on every AVX512_VNNI CPU), and
    # where the 5-row prompt takes the bfloat16 GEMV (one scale per row) instead.
    bf16_rows = dot_w8_gemv_runs(cpu_kernels, min(DECODE_PROMPT_LENGTHS), group_size=64, k=64)
    assert (largest_difference > 0) == (integer_w8_gemv_runs(cpu_kernels, rows=1) or bf16_rows)


def test_default_engine_decodes_4_bit_weights_as_the_float_gemv_does(model_dir, tmp_path, cpu_kernels, one_thread,
                                                                     compiled_cache, monkeypatch):
    default, floating = default_engine_pair(model_dir, tmp_path / "artifact",
                                            CompileConfig(dtype="bfloat16", quant="w4"), "OCTAVO_CPU_W4_GEMV",
                                            monkeypatch)
    prompts = random_prompts(DECODE_PROMPT_LENGTHS, seed=7)
    largest_difference = largest_logit_difference(default, floating, "OCTAVO_CPU_W4_GEMV", "float",
                                                  reference_models(model_dir), prompts, DECODE_TOKENS, monkeypatch)
    assert (largest_difference > 0) == integer_gemv_runs(cpu_kernels)
