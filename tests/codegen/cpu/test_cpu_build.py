"""The native library: built for the target ISA, cached under a key of everything that decides the build."""

from __future__ import annotations

import os
import subprocess
import sysconfig

import torch
from torch.utils import cpp_extension

from octavo.codegen.cpu_backend import build
from octavo.codegen.cpu_backend.build import (
    KERNELS_DIR_ENV,
    SOURCE_DIR,
    SOURCES,
    compile_flags,
    library_dir,
    library_key,
)
from octavo.codegen.cpu_backend.isa import LEVELS, CpuTarget, cpu_target


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


def test_an_edit_to_any_source_or_header_is_another_build(tmp_path, monkeypatch):
    """The key reads every .cpp and .h in csrc/: one byte more in any of them, or a new header, changes it."""
    target = CpuTarget("avx2", False, False)
    copy = tmp_path / "csrc"
    copy.mkdir()
    for path in SOURCE_DIR.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(build, "SOURCE_DIR", copy)
    before = library_key(target)
    assert before == library_key(target)
    keys = {before}
    for path in sorted(copy.iterdir()):
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        keys.add(library_key(target))
        path.write_bytes(original)
    (copy / "new_kernel.h").write_text("#pragma once\n")
    keys.add(library_key(target))
    assert len(keys) == len(list(SOURCE_DIR.iterdir())) + 2


def test_a_changed_compiler_is_another_build(monkeypatch):
    target = CpuTarget("avx2", False, False)
    before = library_key(target)
    monkeypatch.setenv("CXX", "clang++")
    assert library_key(target) != before


def test_the_levels_this_machine_does_not_build_compile_too():
    """The suite builds and runs this CPU's level (and on AVX-512 machines the AVX2 level too, see
    test_cpu_lower_isa_levels); the other levels' sources must compile as well (an AVX2-only or pre-AVX2
    machine builds them at first use). Each source is compiled with that level's flags in syntax-only mode,
    which parses and instantiates every template as the real build does."""
    built = {cpu_target().level, *(("avx2",) if cpu_target().level == "avx512" else ())}
    others = [level for level in LEVELS if level not in built]
    includes = [f"-I{SOURCE_DIR}", *(f"-isystem{path}" for path in cpp_extension.include_paths()),
                f"-isystem{sysconfig.get_paths()['include']}"]
    failures = []
    for level in others:
        # The C++ standard and the defines cpp_extension.load compiles the library with.
        command = [os.environ.get("CXX", "c++"), "-fsyntax-only", "-std=c++20", "-DTORCH_API_INCLUDE_EXTENSION_H",
                   *includes, *compile_flags(CpuTarget(level, False, False))]
        runs = {name: subprocess.Popen([*command, str(SOURCE_DIR / name)], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True) for name in SOURCES}
        for name, run in runs.items():
            output, _ = run.communicate(timeout=600)
            if run.returncode != 0:
                errors = [line for line in output.splitlines() if "error" in line]
                failures.append(f"{level} {name}: " + "\n".join(errors[:5]))
    assert others and not failures, "\n".join(failures)
