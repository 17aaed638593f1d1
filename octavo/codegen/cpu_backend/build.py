"""Build the native CPU kernels for this machine at first use, cache them, load them.

The C++ sources in ``csrc/`` are compiled with torch.utils.cpp_extension into one shared
library that registers the ``octavo_cpu::`` ops with TORCH_LIBRARY. It is cached under the
Octavo cache dir in ``cpu_kernels/<level>-<key>/`` (OCTAVO_CPU_KERNELS_DIR replaces
``<cache dir>/cpu_kernels``), the key hashing the sources, the compiler
flags and command, the target ISA level and the torch version, so a changed source, flag,
CPU level or torch gets its own build and a cached one is only reused where it is exact.

Two processes starting at once do not corrupt the cache: a file lock lets one build while
the other waits, and the build happens in a private staging directory renamed into place
only when complete (a crash leaves no half-written library behind).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from octavo.cache_dir import cache_root, exclusive_lock
from octavo.codegen.cpu_backend.isa import CpuTarget, cpu_target
from octavo.errors import OctavoError

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("paged_attention.cpp", "linear_w16.cpp", "linear_quantized.cpp", "linear_bf16.cpp", "argmax_rows.cpp",
           "moe.cpp", "shm_collectives.cpp", "linear_w8a8.cpp")
LIBRARY_NAME = "octavo_cpu_kernels"
# No -ffast-math: results must not depend on how the compiler reassociates. Contraction off: an FMA
# only where the source asks for one, so the same computation rounds the same in every code path.
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)
KERNELS_DIR_ENV = "OCTAVO_CPU_KERNELS_DIR"


class CpuKernelsUnavailableError(OctavoError):
    """The CPU kernels cannot be built or loaded here; the message says what is missing."""


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library: where it is, the target it was built for and what it reports of itself."""

    path: Path
    target: CpuTarget
    build_info: str


_loaded: CpuKernels | None = None
_failure: str | None = None


def load_cpu_kernels() -> CpuKernels:
    """Load the octavo_cpu ops, building them first on a cold cache (about a minute); once per process.

    Raises CpuKernelsUnavailableError (again on every later call) when no compiler, no ninja or a
    failed build stands in the way.
    """
    global _loaded, _failure
    if _loaded is not None:
        return _loaded
    if _failure is not None:
        raise CpuKernelsUnavailableError(_failure)
    target = cpu_target()
    try:
        path, already_loaded = _library(target)
        if not already_loaded:
            torch.ops.load_library(str(path))
    except CpuKernelsUnavailableError as error:
        _failure = str(error)
        raise
    from octavo.codegen.cpu_backend.fake import register_fake_kernels

    register_fake_kernels()
    _loaded = CpuKernels(path, target, torch.ops.octavo_cpu.build_info())
    logger.info("CPU kernels loaded: %s, built for %s (%s)", path, target.describe(), _loaded.build_info)
    return _loaded


def loaded_cpu_kernels() -> CpuKernels | None:
    """The library this process loaded, or None: for code that uses a kernel only where it is loaded already."""
    return _loaded


def compile_flags(target: CpuTarget) -> list[str]:
    return [*BASE_FLAGS, *target.compile_flags]


def source_files() -> list[Path]:
    """Every C++ source and header in csrc/, by name: any of them edited is another build, with no list of headers
    to keep (a header left off one would leave its edits out of the key, and an old library in use)."""
    return sorted(path for path in SOURCE_DIR.iterdir() if path.suffix in (".cpp", ".h"))


def library_key(target: CpuTarget) -> str:
    """sha256 over the sources, the compiler and its flags, the ISA level and the torch version."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(json.dumps({"flags": compile_flags(target), "link": list(LINK_FLAGS), "level": target.level,
                              "compiler": _compiler(), "torch": torch.__version__}).encode())
    return digest.hexdigest()[:16]


def library_dir(target: CpuTarget) -> Path:
    root = os.environ.get(KERNELS_DIR_ENV) or cache_root() / "cpu_kernels"
    return Path(root).expanduser() / f"{target.level}-{library_key(target)}"


def _library(target: CpuTarget) -> tuple[Path, bool]:
    """The cached library's path, building it when missing; True when this call's build loaded it."""
    directory = library_dir(target)
    library = directory / f"{LIBRARY_NAME}.so"
    if library.is_file():
        return library, False
    _check_toolchain()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(directory.parent / f"{directory.name}.lock"):
        if library.is_file():  # another process built it while this one waited
            return library, False
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
        try:
            _build(staging, target)
            if directory.exists():
                shutil.rmtree(directory)
            staging.rename(directory)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return library, True


def _build(directory: Path, target: CpuTarget) -> None:
    """Compile the sources into `directory` (cpp_extension also loads the result into this process)."""
    from torch.utils import cpp_extension

    logger.warning("building the Octavo CPU kernels for %s (first use on this machine, about a minute; "
                   "cached in %s)", target.describe(), directory.parent)
    start = time.perf_counter()
    try:
        cpp_extension.load(name=LIBRARY_NAME, sources=[str(SOURCE_DIR / name) for name in SOURCES],
                           extra_cflags=compile_flags(target), extra_ldflags=list(LINK_FLAGS),
                           extra_include_paths=[str(SOURCE_DIR)], build_directory=str(directory),
                           is_python_module=False, verbose=False)
    except (RuntimeError, OSError) as error:
        lines = str(error).strip().splitlines()
        raise CpuKernelsUnavailableError("building the CPU kernels failed:\n" + "\n".join(lines[-25:])) from error
    logger.info("CPU kernels built in %.1fs", time.perf_counter() - start)


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _check_toolchain() -> None:
    from torch.utils import cpp_extension

    compiler = _compiler()
    if shutil.which(compiler) is None:
        raise CpuKernelsUnavailableError(f"no C++ compiler found ({compiler!r} is not on PATH): install g++ "
                                    "(e.g. apt-get install g++) or point CXX at one")
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as error:
        raise CpuKernelsUnavailableError("ninja is not installed: pip install ninja") from error
