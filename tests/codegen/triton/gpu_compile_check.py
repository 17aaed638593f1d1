"""Compile every Triton kernel of the backend for a CUDA GPU (sm_90) down to a cubin, without a GPU.

The interpreter accepts code that the compiler rejects (a loop-carried value
whose type changes, a constexpr misuse); compiling for the real target
catches those on CPU-only machines. Run without TRITON_INTERPRET:
``python tests/codegen/triton/gpu_compile_check.py`` (test_triton_gpu_compile.py
does). Prints one line per kernel; exits 1 if any kernel fails to compile.

Generated fused_pointwise kernels are compiled with the launcher's options
(fused_pointwise.LAUNCH_OPTIONS), and a bf16 multiply-then-add program must
show no fused multiply-add in its PTX: each step rounds as torch rounds.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import traceback
from dataclasses import dataclass, field

# Where the generated kernel of the check is written (before octavo reads the variable); a directory of the
# check's own is removed when the process exits.
if "OCTAVO_CACHE_DIR" not in os.environ:
    _CACHE_DIR = tempfile.TemporaryDirectory(prefix="octavo-gpu-compile-")
    os.environ["OCTAVO_CACHE_DIR"] = _CACHE_DIR.name

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
INDEX_POINTERS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                  "slot_mapping_ptr": "*i64", "positions_ptr": "*i64", "sorted_pairs_ptr": "*i32",
                  "block_experts_ptr": "*i32"}
FLOAT_SCALARS = {"qk_scale", "eps", "soft_cap"}


@dataclass
class Case:
    """One kernel to compile: its constexprs, the data pointers' type, compile options, pointer overrides."""

    name: str
    kernel: object
    constexprs: dict
    data_type: str
    options: dict = field(default_factory=dict)
    pointers: dict = field(default_factory=dict)
    no_fma: bool = False  # the PTX must hold no fused multiply-add


def signature(case: Case) -> dict[str, str]:
    """Triton signature types: pointers of `data_type` (index tensors int32/int64), int32 and fp32 scalars."""
    types = {}
    for name in case.kernel.arg_names:
        if name in case.constexprs:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = case.pointers.get(name) or INDEX_POINTERS.get(name, case.data_type)
        else:
            types[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return types


def pointwise_program(steps: list[tuple[str, list]]) -> str:
    from octavo.ir.ops.fused_pointwise import Reference, encode_program

    def reference(arg):
        return Reference(*arg) if isinstance(arg, tuple) else arg

    return encode_program([{"op": op, "args": [reference(arg) for arg in args]} for op, args in steps])


def cases() -> list[Case]:
    from octavo.codegen.triton_backend import (
        activation,
        attention_decode,
        attention_prefill,
        fused_pointwise,
        kv_cache_write,
        moe,
        norm,
        quantized_linear,
        rotary,
    )
    from octavo.ir.ops.fused_pointwise import Reference, encode_program

    rms_program = encode_program([
        {"op": "aten._to_copy.default", "args": [Reference("input", 0)], "kwargs": {"dtype": torch.float32}},
        {"op": "aten.pow.Tensor_Scalar", "args": [Reference("step", 0), 2]},
        {"op": "aten.mean.dim", "args": [Reference("step", 1), [-1], True]},
        {"op": "aten.rsqrt.default", "args": [Reference("step", 2)]},
        {"op": "aten.mul.Tensor", "args": [Reference("input", 1), Reference("step", 3)]},
    ])
    rms_dtypes = {"STEP0_DTYPE": tl.float32, "STEP1_DTYPE": tl.float32, "STEP2_DTYPE": tl.float32,
                  "STEP3_DTYPE": tl.float32, "STEP4_DTYPE": tl.bfloat16}
    # x * y + z in bf16: contracted, the two steps would become one fma.rn.bf16x2 (one rounding).
    multiply_add = pointwise_program([("aten.mul.Tensor", [("input", 0), ("input", 1)]),
                                      ("aten.add.Tensor", [("step", 0), ("input", 2)])])
    attention = {"BLOCK_N": 32, "BLOCK_D": 128, "SOFT_CAP": False}
    pointwise = fused_pointwise.LAUNCH_OPTIONS
    quantized = {"HAS_BIAS": True, "DOT_PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32}
    grouped = {"A_ROWS_ARE_TOKENS": True, "LAYOUT": moe.FLOAT, "MUL_ROUTING": False, "DOT_PRECISION": "tf32",
               "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32}
    return [
        Case("kv_cache_write", kv_cache_write._kv_cache_write_kernel, {"BLOCK_T": 2, "BLOCK_H": 8, "BLOCK_D": 128},
             "*bf16"),
        Case("attention_decode bf16", attention_decode._decode_attention_kernel,
             {"BLOCK_G": 16, **attention, "DOT_PRECISION": "tf32"}, "*bf16"),
        Case("attention_decode fp32", attention_decode._decode_attention_kernel,
             {"BLOCK_G": 16, **attention, "DOT_PRECISION": "ieee"}, "*fp32"),
        Case("attention_prefill bf16", attention_prefill._prefill_attention_kernel,
             {"BLOCK_M": 64, **attention, "DOT_PRECISION": "tf32"}, "*bf16"),
        # Triton passes an int argument equal to 1 as a constant: one sequence, no GQA.
        Case("attention_prefill fp32, one sequence", attention_prefill._prefill_attention_kernel,
             {"BLOCK_M": 64, **attention, "DOT_PRECISION": "ieee", "num_seqs": 1, "group_size": 1}, "*fp32"),
        Case("attention_decode bf16, no GQA", attention_decode._decode_attention_kernel,
             {"BLOCK_G": 16, **attention, "DOT_PRECISION": "tf32", "group_size": 1}, "*bf16"),
        Case("attention_decode bf16, soft-capped", attention_decode._decode_attention_kernel,
             {"BLOCK_G": 16, **attention, "DOT_PRECISION": "tf32", "SOFT_CAP": True}, "*bf16"),
        Case("attention_prefill bf16, soft-capped", attention_prefill._prefill_attention_kernel,
             {"BLOCK_M": 64, **attention, "DOT_PRECISION": "tf32", "SOFT_CAP": True}, "*bf16"),
        Case("rms_norm (fused add)", norm._rms_norm_kernel,
             {"ADD_RESIDUAL": True, "MULTIPLY_IN_FLOAT32": False, "BLOCK_R": 2, "BLOCK_H": 1024}, "*bf16"),
        Case("rms_norm (weight in float32)", norm._rms_norm_kernel,
             {"ADD_RESIDUAL": False, "MULTIPLY_IN_FLOAT32": True, "BLOCK_R": 2, "BLOCK_H": 1024}, "*bf16"),
        Case("moe grouped gemm (gate/up)", moe._grouped_gemm_kernel, grouped, "*bf16"),
        Case("moe grouped gemm (down, routed)", moe._grouped_gemm_kernel,
             {**grouped, "A_ROWS_ARE_TOKENS": False, "MUL_ROUTING": True}, "*bf16"),
        Case("rotary", rotary._rotary_kernel, {"BLOCK_R": 32, "BLOCK_HALF": 64}, "*bf16"),
        Case("silu_and_mul", activation._gated_activation_kernel, {"ACTIVATION": 0, "BLOCK_R": 2, "BLOCK": 1024},
             "*bf16"),
        Case("fused_pointwise (generated)", fused_pointwise.load_kernel(rms_program),
             {**rms_dtypes, "BLOCK_R": 4, "BLOCK_N": 512}, "*bf16", pointwise),
        Case("fused_pointwise bf16 x * y + z, no fma", fused_pointwise.load_kernel(multiply_add),
             {"STEP0_DTYPE": tl.bfloat16, "STEP1_DTYPE": tl.bfloat16, "BLOCK_R": 4, "BLOCK_N": 64}, "*bf16",
             pointwise, no_fma=True),
        Case("quantized_linear w4, bf16", quantized_linear._quantized_linear_kernel, {"LAYOUT": 1, **quantized},
             "*bf16", pointers={"qweight_ptr": "*u8", "scales_ptr": "*fp16", "offsets_ptr": "*fp16"}),
        Case("quantized_linear w8, bf16, 64-row tiles", quantized_linear._quantized_linear_kernel,
             {"LAYOUT": 0, **quantized, "BLOCK_M": 64}, "*bf16", pointers={"qweight_ptr": "*i8"}),
    ]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this check compiles for the GPU")
        return 2
    failures = 0
    for case in cases():
        try:
            compiled = triton.compile(ASTSource(case.kernel, signature(case), case.constexprs), target=TARGET,
                                      options={"num_warps": 4, **case.options})
        except Exception:  # report every kernel, then fail
            failures += 1
            print(f"FAIL  {case.name}\n{traceback.format_exc()}")
            continue
        fused = re.findall(r"^\s*(fma\.\S+)", compiled.asm["ptx"], flags=re.MULTILINE)
        if case.no_fma and fused:
            failures += 1
            print(f"FAIL  {case.name}: the PTX fuses a multiply and an add ({', '.join(sorted(set(fused)))})")
            continue
        print(f"ok    {case.name}: {len(compiled.asm['cubin'])} bytes of sm_90 code")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
