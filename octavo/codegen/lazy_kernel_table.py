"""A backend package's `KERNELS`, built on first access (building may import Triton or compile C++)."""

from __future__ import annotations

from collections.abc import Callable


def lazy_kernel_table(module_globals: dict, build: Callable[[], dict]) -> Callable[[str], dict]:
    """A module `__getattr__` that builds `KERNELS` with `build()` once and keeps it in the module."""

    def getattr_(name: str) -> dict:
        if name == "KERNELS":
            table = build()
            module_globals["KERNELS"] = table
            return table
        raise AttributeError(f"module {module_globals['__name__']!r} has no attribute {name!r}")

    return getattr_
