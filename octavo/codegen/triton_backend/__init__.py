"""The Triton backend: template kernels for the octavo op set, generated kernels for fused groups.

`KERNELS` (op overload -> launcher) is built on first access, so that
importing this package (for `sources`, which only produces kernel text)
needs no Triton: an artifact can be written on a machine without it.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "KERNELS":
        from octavo.codegen.triton_backend.kernel_table import build_kernel_table

        table = build_kernel_table()
        globals()["KERNELS"] = table
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
