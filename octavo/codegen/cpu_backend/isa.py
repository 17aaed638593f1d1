"""The vector ISA the CPU kernels are built for: what this CPU has, capped by ATEN_CPU_CAPABILITY.

The kernels vectorize with ATen's at::vec, which follows the CPU_CAPABILITY_* macro of the
build, and with intrinsics guarded by the same macro; one build per ISA level:

- ``avx512``: AVX-512 F/BW/VL/DQ (+FMA, F16C), the level ATen itself dispatches to on such CPUs;
- ``avx2``: AVX2 + FMA + F16C;
- ``default``: no vector extension (portable C++, e.g. on CPUs without AVX2 or on non-x86).

ATEN_CPU_CAPABILITY (``default``, ``avx2``, ``avx512``), which makes ATen run a lower level than
the CPU has, caps the build too: ``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 machine builds and
runs the AVX2 kernels, as an AVX2-only machine would.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import cache

import torch

LEVELS = ("default", "avx2", "avx512")
CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"

_FLAGS = {
    "default": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}


@dataclass(frozen=True)
class CpuTarget:
    """An ISA level and the CPU features worth knowing beside it (native bf16 / fp16 matmul)."""

    level: str
    avx512_bf16: bool
    amx: bool
    amx_fp16: bool = False
    amx_int8: bool = False

    @property
    def compile_flags(self) -> list[str]:
        """Compiler flags selecting this level's instructions and at::vec implementation."""
        macro = self.level.upper()
        return [*_FLAGS[self.level], f"-DCPU_CAPABILITY={macro}", f"-DCPU_CAPABILITY_{macro}"]

    def describe(self) -> str:
        features = (("avx512_bf16", self.avx512_bf16), ("amx", self.amx), ("amx_fp16", self.amx_fp16))
        extras = [name for name, present in features if present]
        return self.level.upper() + (f" (+{', '.join(extras)})" if extras else "")


def host_level() -> str:
    """The best level this CPU supports (ignoring ATEN_CPU_CAPABILITY)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return "default"
    if torch.cpu._is_avx512_supported():
        return "avx512"
    if torch.cpu._is_avx2_supported():
        return "avx2"
    return "default"


def capped_level(level: str, requested: str | None) -> str:
    """`level` lowered to the ATEN_CPU_CAPABILITY value `requested` (unknown values cap nothing)."""
    requested = (requested or "").strip().lower()
    if requested not in LEVELS:
        return level
    return LEVELS[min(LEVELS.index(level), LEVELS.index(requested))]


@cache
def cpu_target() -> CpuTarget:
    """This process's build target: the host's level capped by ATEN_CPU_CAPABILITY, with its bf16 features.

    The native-bf16 features are reported only where the level keeps AVX-512 (a capped build
    behaves like a machine without them).
    """
    level = capped_level(host_level(), os.environ.get(CAPABILITY_ENV))
    wide = level == "avx512"
    return CpuTarget(level, avx512_bf16=wide and torch.cpu._is_avx512_bf16_supported(),
                     amx=wide and torch.cpu._is_amx_tile_supported(),
                     amx_fp16=wide and torch.cpu._is_amx_fp16_supported(),
                     amx_int8=wide and torch.cpu._is_amx_tile_supported() and "amx_int8" in _linux_cpu_flags())


def _linux_cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere: torch has no AMX-INT8 query)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()
