"""The AVX2 build's kernels run, not only compile, on AVX-512 machines: an AVX-512 CPU executes AVX2 code.

The suite builds and tests the kernels of this CPU's level; the AVX2 build (what every AVX2-only CPU,
e.g. AMD's before Zen 4, runs) would otherwise be checked here only by test_cpu_build's syntax-only
compile. So on an AVX-512 machine the kernel tests run a second time in a subprocess under
ATEN_CPU_CAPABILITY=avx2 (which builds and loads the AVX2 library, as on such a CPU) and
ONEDNN_MAX_CPU_ISA=AVX2 (ATen's GEMMs and oneDNN at the same level, as the references there compute).
On an AVX2 machine the suite's own run is the AVX2 run. The library is cached like the host's
(OCTAVO_CPU_KERNELS_DIR); on a cold cache the session builds it beside the tests that run first, on CPU
time they leave idle (tests/background_builds.py), and this test waits for that build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from octavo.codegen.cpu_backend.isa import cpu_target
from tests.conftest import AVX2_ENVIRONMENT, avx2_rerun_applies

# The first proves the subprocess loaded a library built for AVX2 (its build_info names the level).
KERNEL_TESTS = ("test_cpu_build.py::test_the_loaded_library_was_built_for_this_target",
                "test_cpu_linear_quantized.py", "test_cpu_linear_w16.py", "test_cpu_paged_attention.py",
                "test_cpu_paged_prefill.py", "test_cpu_argmax_rows.py", "test_cpu_linear_bf16.py",
                "test_cpu_w8_integer_gemv.py", "test_cpu_w4_integer_gemv.py", "test_cpu_packed_weights.py",
                "test_cpu_linear_w8a8.py")
# Independent of the level (the ops' fake kernels), so run once, at the host's.
LEVEL_INDEPENDENT = "not fake_kernels"


def test_the_avx2_kernels_pass_their_tests_on_this_machine(avx2_cpu_kernels):
    if not avx2_rerun_applies():
        # An AVX2 machine (or a run already capped to AVX2) tests the AVX2 build in this very run.
        assert cpu_target().level in ("avx2", "default")
        return
    here = Path(__file__).parent
    environment = {**os.environ, **AVX2_ENVIRONMENT}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", LEVEL_INDEPENDENT,
                             *(str(here / name) for name in KERNEL_TESTS)],
                            capture_output=True, text=True, timeout=1200, env=environment,
                            cwd=here.parent.parent.parent)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary
