"""--backend triton: the CPU rule (interpreter only) and the kernel coverage (auto on CPU: tests/codegen/cpu)."""

from __future__ import annotations

import os

import pytest
import torch

from octavo.codegen.lowering import backend_kernels
from octavo.config import EngineConfig
from octavo.errors import OctavoError
from octavo.ir.ops.collectives import RUNTIME_LOWERED_OPS
from octavo.runtime.engine import LLMEngine, resolve_backend


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(OctavoError, match=r"needs a CUDA device.*--backend torch"):
        resolve_backend("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", torch.device("cpu")) == "triton"


def test_engine_refuses_triton_on_cpu_without_interpreter(monkeypatch, tiny_artifact):
    artifact = tiny_artifact("llama")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(OctavoError, match="backend triton needs a CUDA device"):
        LLMEngine(artifact, EngineConfig(backend="triton", device="cpu", num_kv_blocks=8))


def test_every_octavo_op_has_a_triton_kernel_and_a_torch_kernel():
    """Every op but the collectives, which the distributed runtime lowers to torch.distributed itself."""
    import octavo.ir.ops  # noqa: F401

    registered = {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("octavo::")}
    assert set(RUNTIME_LOWERED_OPS) <= registered
    registered -= set(RUNTIME_LOWERED_OPS)
    for backend in ("torch", "triton"):
        covered = {op.name().split("::", 1)[1].split(".")[0] for op in backend_kernels(backend)}
        assert registered <= covered, f"backend {backend} lacks {sorted(registered - covered)}"


def test_a_triton_engine_keeps_compiled_kernels_in_the_octavo_cache_dir(monkeypatch, tiny_artifact, tmp_path, device):
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path / "octavo"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    LLMEngine(tiny_artifact("llama"), EngineConfig(backend="triton", device=device.type, num_kv_blocks=8))
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "octavo" / "triton")
    # Where Triton writes what it compiles (read when it compiles, so it follows the variable).
    from triton import knobs

    assert knobs.cache.dir == str(tmp_path / "octavo" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    LLMEngine(tiny_artifact("llama"), EngineConfig(backend="triton", device=device.type, num_kv_blocks=8))
    assert knobs.cache.dir == str(tmp_path / "mine")
