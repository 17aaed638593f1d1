"""--backend cpu / auto on CPU: the native kernels when they build, else torch with one warning saying why."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from octavo.codegen.lowering import backend_kernels
from octavo.errors import OctavoError
from octavo.runtime.engine import resolve_backend


def test_auto_on_cpu_is_the_native_backend(cpu_kernels):
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_backend("cpu", torch.device("cpu")) == "cpu"


def test_cpu_backend_covers_every_op_the_torch_backend_does(cpu_kernels):
    """The cpu table is the torch table with the ops that have C++ kernels pointed at them."""
    table, torch_table = backend_kernels("cpu"), backend_kernels("torch")
    assert set(torch_table) <= set(table)
    ops, native = torch.ops.octavo, torch.ops.octavo_cpu
    assert table[ops.paged_attention.default] is native.paged_attention.default
    assert table[ops.linear_w16.default] is native.linear_w16.default
    assert table[ops.linear_w8.default] is native.linear_w8.default
    assert table[ops.linear_w4.default] is native.linear_w4.default
    assert table[ops.moe.default] is native.moe.default
    assert {op for op in table if table[op] is not torch_table[op]} == {
        ops.paged_attention.default, ops.linear_w16.default, ops.linear_w8.default, ops.linear_w4.default,
        ops.moe.default}


def test_cpu_backend_refuses_other_devices():
    with pytest.raises(OctavoError, match="backend cpu cannot run: it runs on CPU only"):
        resolve_backend("cpu", torch.device("cuda"))


def test_without_a_compiler_auto_falls_back_with_one_warning(tmp_path):
    """A machine without g++ (and nothing cached): auto runs torch and says what is missing, once."""
    script = textwrap.dedent("""
        import logging, torch
        from octavo.errors import OctavoError
        from octavo.runtime.engine import resolve_backend
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        print(resolve_backend("auto", torch.device("cpu")), resolve_backend("auto", torch.device("cpu")))
        try:
            resolve_backend("cpu", torch.device("cpu"))
        except OctavoError as error:
            print("error:", error)
    """)
    environment = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "OCTAVO_CPU_KERNELS_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env=environment)
    assert result.returncode == 0, result.stderr
    choices, error = result.stdout.strip().splitlines()
    assert choices == "torch torch"
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, result.stderr
    assert "native CPU kernels are unavailable" in warnings[0] and "no C++ compiler found" in warnings[0]
    assert "install g++" in warnings[0]
    assert error.startswith("error: backend cpu cannot run: no C++ compiler found")
