"""When the Triton backend can run: on CUDA devices, and on CPU only inside Triton's interpreter (tests)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from octavo.cache_dir import cache_root
from octavo.errors import OctavoError

INTERPRET_ENV = "TRITON_INTERPRET"
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
_TRUE_VALUES = ("1", "true", "on", "yes")
QUANTIZED_CACHE_ERROR = ("the Triton backend has no int8/fp8 KV cache kernels yet: run this artifact with --backend "
                         "torch, or compile it without --kv-cache-dtype")


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels in its numpy interpreter."""
    return os.environ.get(INTERPRET_ENV, "0").strip().lower() in _TRUE_VALUES


def check_triton_backend(device: torch.device) -> None:
    """Raise OctavoError unless the Triton backend can run on `device`."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        raise OctavoError("backend triton needs the triton package: pip install 'octavo[triton]' "
                          "(or choose --backend torch)") from error
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        return
    raise OctavoError(f"backend triton needs a CUDA device, got {device.type}; use --backend torch on CPU "
                      f"({INTERPRET_ENV}=1 runs the Triton kernels in Triton's slow interpreter, for tests)")


def use_octavo_triton_cache() -> Path:
    """Point Triton's compile cache at the Octavo cache dir's ``triton/`` unless TRITON_CACHE_DIR is set.

    Compiled kernels then persist across processes next to the compiled executors and the generated kernel
    sources (OCTAVO_CACHE_DIR moves them all together), so a second engine start compiles nothing. Triton
    reads the variable when it compiles, so this takes effect for every kernel not compiled yet.
    """
    os.environ.setdefault(TRITON_CACHE_ENV, str(cache_root() / "triton"))
    return Path(os.environ[TRITON_CACHE_ENV])


def rows_per_program(block_columns: int, num_rows: int) -> int:
    """How many rows one program of a row-wise kernel handles (a power of two).

    On a GPU, enough rows to give a program about 2048 elements (at most 16
    rows), so narrow rows do not leave most lanes idle. In the interpreter a
    program's fixed cost dominates: as many rows as fit 32768 elements.
    """
    if interpreting():
        return max(1, min(_next_power_of_2(num_rows), 32768 // block_columns))
    return max(1, min(16, 2048 // block_columns))


def _next_power_of_2(value: int) -> int:
    return 1 if value <= 1 else 1 << (value - 1).bit_length()


def check_triton_kv_layout(kv_layout: dict) -> None:
    """Raise OctavoError when the artifact's KV cache needs kernels the Triton backend lacks (int8 / fp8 caches)."""
    if kv_layout.get("scale_inputs"):
        raise OctavoError(f"{QUANTIZED_CACHE_ERROR} (this artifact's cache is {kv_layout['cache_dtype']})")
