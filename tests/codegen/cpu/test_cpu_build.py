"""The native library: built for the target ISA, cached under a key of everything that decides the build."""

from __future__ import annotations

import torch

from octavo.codegen.cpu_backend.build import KERNELS_DIR_ENV, library_dir, library_key
from octavo.codegen.cpu_backend.isa import CpuTarget


def test_the_loaded_library_was_built_for_this_target(cpu_kernels):
    info = torch.ops.octavo_cpu.build_info()
    assert info == cpu_kernels.build_info
    assert info.split()[0] == cpu_kernels.target.level.upper()
    assert cpu_kernels.path.parent == library_dir(cpu_kernels.target)
    assert cpu_kernels.path.is_file()


def test_each_isa_level_gets_its_own_build(tmp_path, monkeypatch):
    keys = {level: library_key(CpuTarget(level, False, False)) for level in ("default", "avx2", "avx512")}
    assert len(set(keys.values())) == 3
    # bf16/AMX features change no flag: one build serves CPUs with and without them.
    assert library_key(CpuTarget("avx512", True, True)) == keys["avx512"]
    monkeypatch.setenv(KERNELS_DIR_ENV, str(tmp_path))
    assert library_dir(CpuTarget("avx2", False, False)) == tmp_path / f"avx2-{keys['avx2']}"


def test_a_changed_compiler_is_another_build(monkeypatch):
    target = CpuTarget("avx2", False, False)
    before = library_key(target)
    monkeypatch.setenv("CXX", "clang++")
    assert library_key(target) != before
