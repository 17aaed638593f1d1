"""The cpu backend: native C++ kernels for the host's vector ISA, the torch kernels for the other ops.

``octavo_cpu::paged_attention`` (KV write + decode/prefill attention reading the paged cache in
place), ``octavo_cpu::linear_w16`` (float32 linear over 16-bit weights) and
``octavo_cpu::linear_w8`` / ``linear_w4`` / ``linear_fp8`` (float32 linears over the int8 / 4-bit /
float8_e4m3fn layouts, the weights dequantized in the kernel) and ``octavo_cpu::moe`` (a mixture of experts that
runs only the experts its tokens chose) are C++ ops built with torch.utils.cpp_extension at first
use and cached (see build.py, isa.py). `KERNELS` maps every octavo op to its kernel: those to
the C++ ops (OpOverloads with fake impls, opaque to torch.compile), all others to the torch
backend's kernels. It is built on first access, which builds or loads the library. At load,
bound w8 / w4 / fp8 linears are pointed at the C++ ops by weight packing (kernel_table's
native_quantized_kernels).
"""

from __future__ import annotations

from octavo.codegen.lazy_kernel_table import lazy_kernel_table


def _build() -> dict:
    from octavo.codegen.cpu_backend.kernel_table import build_kernel_table

    return build_kernel_table()


__getattr__ = lazy_kernel_table(globals(), _build)
