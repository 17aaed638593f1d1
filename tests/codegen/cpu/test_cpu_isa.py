"""The build target: the host's ISA level, capped by ATEN_CPU_CAPABILITY, and its compiler flags."""

from __future__ import annotations

import pytest

from octavo.codegen.cpu_backend.isa import CpuTarget, capped_level, cpu_target, host_level


def test_aten_cpu_capability_caps_the_level():
    assert capped_level("avx512", "avx2") == "avx2"
    assert capped_level("avx512", "DEFAULT") == "default"
    assert capped_level("avx2", "avx512") == "avx2"  # a cap never raises the level
    assert capped_level("avx512", None) == "avx512"
    assert capped_level("avx2", "zvector") == "avx2"  # not an x86 level: caps nothing


def test_flags_select_each_level():
    avx512, avx2, default = (CpuTarget(level, False, False).compile_flags for level in ("avx512", "avx2", "default"))
    assert "-mavx512bw" in avx512 and "-DCPU_CAPABILITY_AVX512" in avx512
    assert "-mavx2" in avx2 and "-mfma" in avx2 and not any("avx512" in flag for flag in avx2)
    assert "-DCPU_CAPABILITY_AVX2" in avx2
    assert not any(flag.startswith("-m") for flag in default) and "-DCPU_CAPABILITY=DEFAULT" in default


@pytest.mark.parametrize("requested", ["default", "avx2"])
def test_cpu_target_follows_the_environment(requested, monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", requested)
    cpu_target.cache_clear()
    try:
        target = cpu_target()
    finally:
        cpu_target.cache_clear()
    assert target.level == capped_level(host_level(), requested)
    assert not target.avx512_bf16 and not target.amx  # a capped build behaves like a CPU without them
