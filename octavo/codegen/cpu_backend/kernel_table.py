"""KERNELS of the cpu backend: octavo op overload -> kernel (loads, or first builds, the C++ library)."""

from __future__ import annotations

import torch

from octavo.codegen.cpu_backend.build import load_cpu_kernels


def native_quantized_kernels() -> dict:
    """Quantized layout -> the C++ linear over it (the octavo op's arguments, plus bf16_gemm); "w8a8" and
    "w8a8_pack": the int8-activation linear of w8a8 artifacts and the op that packs its weights."""
    load_cpu_kernels()
    native = torch.ops.octavo_cpu
    return {"w8": native.linear_w8.default, "w4": native.linear_w4.default, "fp8": native.linear_fp8.default,
            "w8a8": native.linear_w8a8.default, "w8a8_pack": native.pack_w8a8.default}


def native_bf16_linear():
    """The C++ linear for bfloat16 models (aten.linear's arguments), which lowering points their linears at."""
    load_cpu_kernels()
    return torch.ops.octavo_cpu.linear_bf16.default


def build_kernel_table() -> dict:
    """The torch backend's table with the ops that have a C++ kernel pointed at it."""
    load_cpu_kernels()
    from octavo.codegen.torch_backend import KERNELS as TORCH_KERNELS

    octavo, native = torch.ops.octavo, torch.ops.octavo_cpu
    return {
        **TORCH_KERNELS,
        octavo.paged_attention.default: native.paged_attention.default,
        octavo.linear_w16.default: native.linear_w16.default,
        octavo.linear_w8.default: native.linear_w8.default,
        octavo.linear_w4.default: native.linear_w4.default,
        octavo.linear_fp8.default: native.linear_fp8.default,
        octavo.moe.default: native.moe.default,
    }


def cpu_backend_problem() -> str | None:
    """None when the cpu backend can run here, else what stands in the way (no compiler, build failure...)."""
    from octavo.codegen.cpu_backend.build import CpuKernelsUnavailableError

    try:
        load_cpu_kernels()
    except CpuKernelsUnavailableError as error:
        return str(error)
    return None
