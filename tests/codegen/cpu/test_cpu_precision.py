"""--dtype auto and the slow-dtype warning: bf16 compute where the CPU has it natively (AMX, AVX512_BF16), else fp32."""

from __future__ import annotations

import pytest

from octavo.codegen.cpu_backend.isa import CpuTarget
from octavo.codegen.cpu_backend.precision import (
    FIX_HINT,
    choose_precision,
    fast_compute_dtypes,
    resolve_precision,
    slow_dtype_warning,
)
from octavo.config import CompileConfig

AMX = CpuTarget("avx512", avx512_bf16=True, amx=True, amx_fp16=True)
AVX512_BF16 = CpuTarget("avx512", avx512_bf16=True, amx=False)
AVX2 = CpuTarget("avx2", avx512_bf16=False, amx=False)


def test_auto_picks_bf16_where_native():
    for target, native in ((AMX, "AMX"), (AVX512_BF16, "AVX512_BF16")):
        choice = choose_precision(target=target)
        assert (choice.dtype, choice.weight_dtype) == ("bfloat16", "bfloat16")
        assert f"{native} computes bfloat16 natively" in choice.reason
    choice = choose_precision(target=AVX2)
    assert (choice.dtype, choice.weight_dtype) == ("float32", "float32")
    assert "no native bfloat16 matmul" in choice.reason and "--weight-dtype bfloat16" in choice.reason
    narrowed = choose_precision("bfloat16", AVX2)
    assert (narrowed.dtype, narrowed.weight_dtype) == ("float32", "bfloat16")
    assert "float32 compute over bfloat16 weights" in narrowed.reason
    # Asking for fp16 storage keeps float32 compute even where bf16 compute would be fast.
    assert (choose_precision("float16", AMX).dtype, choose_precision("float16", AMX).weight_dtype) == (
        "float32", "float16")


def test_resolve_precision_touches_only_auto():
    explicit = CompileConfig(dtype="float32")
    assert resolve_precision(explicit) is explicit
    resolved = resolve_precision(CompileConfig())
    choice = choose_precision()
    assert (resolved.dtype, resolved.storage_dtype) == (choice.dtype, choice.weight_dtype)
    assert resolved.dtype_choice == f"auto: {choice.reason}"
    quantized = resolve_precision(CompileConfig(quant="w8"))
    # A quantized config computes as an unquantized one; the scheme stores the weights.
    assert (quantized.dtype, quantized.weight_dtype) == (choice.dtype, None)


@pytest.mark.parametrize(("dtype", "target", "slow"), [
    ("float32", AVX2, False), ("bfloat16", AVX2, True), ("bfloat16", AVX512_BF16, False), ("bfloat16", AMX, False),
    ("float16", AVX512_BF16, True), ("float16", AMX, False)])
def test_slow_dtype_warning_says_how_to_fix_it(dtype, target, slow):
    assert (dtype in fast_compute_dtypes(target)) != slow
    warning = slow_dtype_warning(dtype, target)
    assert (warning is not None) == slow
    if slow:
        assert f"computes in {dtype}" in warning and FIX_HINT in warning
