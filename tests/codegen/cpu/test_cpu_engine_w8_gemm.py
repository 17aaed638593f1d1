"""End to end: a bfloat16 model with `--quant w8` on the default engine (cpu backend, compiled executor).

A tiny Llama in bfloat16 with int8 weights (one scale per row), run twice on the compiled executor: as users get
it (prompts of more than 8 tokens take the quantized GEMM, which multiplies the int8 weights as they are against
x's rows as 16-bit integers on CPUs with AMX-INT8) and with OCTAVO_CPU_QUANTIZED_GEMM=amx_bf16 (weights
dequantized to bfloat16 tiles). Both hold the same weights and differ only in how the GEMM rounds x:
tests/codegen/cpu/engine_pairs.py states what must agree.
"""

from __future__ import annotations

import pytest

from octavo.codegen.cpu_backend.isa import cpu_target
from octavo.compiler import compile_model
from octavo.config import CompileConfig
from tests.codegen.cpu.engine_pairs import (
    largest_logit_difference,
    make_engine,
    random_prompts,
    reference_models,
    tiny_llama_d32,
)

PROMPT_LENGTHS = [12, 23, 40]  # every prompt above the GEMV's 8 rows
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    return tiny_llama_d32(tmp_path_factory.mktemp("tiny-llama-w8"), tokenizer_dir)


def test_default_engine_runs_int8_weights_as_the_dequantizing_gemm_does(model_dir, tmp_path, cpu_kernels, one_thread,
                                                                      compiled_cache, monkeypatch):
    artifact = compile_model(model_dir, tmp_path / "artifact", CompileConfig(dtype="bfloat16", quant="w8"))
    monkeypatch.delenv("OCTAVO_CPU_QUANTIZED_GEMM", raising=False)
    default, dequantizing = make_engine(artifact), make_engine(artifact)
    assert default.executor_kind == "compiled" and default.backend == "cpu"

    # The size of one bfloat16 rounding is measured on the float model, which the int8 weights round per row.
    models = reference_models(model_dir)
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    largest_difference = largest_logit_difference(default, dequantizing, "OCTAVO_CPU_QUANTIZED_GEMM", "amx_bf16",
                                                  models, prompts, MAX_TOKENS, monkeypatch)
    # The paths differ exactly where the integer GEMM runs; elsewhere both settings take the same GEMM.
    target = cpu_target()
    integer_gemm = target.level == "avx512" and target.amx and target.avx512_bf16 and target.amx_int8
    assert (largest_difference > 0) == integer_gemm
