"""CPU kernel tests: the native library is built (or loaded from the cache) once per session."""

from __future__ import annotations

import pytest

from octavo.codegen.cpu_backend.build import CpuKernels, load_cpu_kernels


@pytest.fixture(scope="session")
def cpu_kernels() -> CpuKernels:
    """The octavo_cpu library for this machine (ATEN_CPU_CAPABILITY=avx2 / default selects the narrower builds)."""
    return load_cpu_kernels()
