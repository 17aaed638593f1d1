"""The Triton backend: template kernels for the octavo op set, generated kernels for fused groups.

`KERNELS` (op overload -> launcher) is built on first access, so that
importing this package (for `sources`, which only produces kernel text)
needs no Triton: an artifact can be written on a machine without it.
"""

from __future__ import annotations

from octavo.codegen.lazy_kernel_table import lazy_kernel_table


def _build() -> dict:
    from octavo.codegen.triton_backend.kernel_table import build_kernel_table

    return build_kernel_table()


__getattr__ = lazy_kernel_table(globals(), _build)
