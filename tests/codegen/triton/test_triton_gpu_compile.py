"""Every Triton kernel compiles for a CUDA GPU (sm_90, to a cubin), checked on any machine.

The interpreter runs Python semantics and accepts some code that Triton's
compiler rejects; this compiles each kernel for the real target in a fresh
process without TRITON_INTERPRET (no GPU needed: Triton ships ptxas). A generated
bf16 multiply-then-add kernel must compile without a fused multiply-add.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECK = Path(__file__).with_name("gpu_compile_check.py")


def test_every_kernel_compiles_for_sm90(tmp_path):
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment.update(OCTAVO_CACHE_DIR=str(tmp_path), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    result = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, env=environment,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) == 18, result.stdout
