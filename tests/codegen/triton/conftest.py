"""Triton kernel tests: on CPU under Triton's interpreter (the default), or natively on a GPU.

OCTAVO_TEST_DEVICE selects the device: "cpu" (default) sets TRITON_INTERPRET=1
before any kernel module is imported (@triton.jit reads it when a kernel is
defined); "cuda" runs the same tests on the GPU, compiled (scripts/gpu_check.sh).
tests/conftest.py sets it too, before any test module can import a kernel; it stays set for the
whole pytest process (the engine's backend "auto" is torch on CPU whatever it says).
"""

from __future__ import annotations

import os

TEST_DEVICE = os.environ.get("OCTAVO_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


def _round_bf16_to_nearest_even() -> None:
    """Make the interpreter round float32 -> bfloat16 to nearest even, as GPUs do.

    A GPU lowers the cast to LLVM's fptrunc (round to nearest even), and so
    does torch; Triton 3.9's interpreter truncates instead, which would make
    every bf16 result here differ from torch's in the last bit for reasons
    that do not exist on the hardware the kernels are written for.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter._convert_float
    if getattr(truncating, "rounds_to_nearest_even", False):
        return

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            as_float = np.ascontiguousarray(values).view(np.float32)
            rounded = torch.from_numpy(as_float.copy()).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view(np.uint16)
        return truncating(values, input_dtype, output_dtype, rounding_mode)

    convert.rounds_to_nearest_even = True
    interpreter._convert_float = convert


if TEST_DEVICE == "cpu":
    _round_bf16_to_nearest_even()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the kernels run on in this session (OCTAVO_TEST_DEVICE)."""
    if TEST_DEVICE not in ("cpu", "cuda"):
        pytest.fail(f"OCTAVO_TEST_DEVICE must be cpu or cuda, got {TEST_DEVICE!r}")
    if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail("OCTAVO_TEST_DEVICE=cuda but torch sees no CUDA device")
    return torch.device(TEST_DEVICE)


@pytest.fixture(scope="session", autouse=True)
def kernel_cache_dir(tmp_path_factory):
    """Generated kernels are written to a temporary cache dir, not the user's ~/.cache."""
    directory = tmp_path_factory.mktemp("octavo-cache")
    previous = os.environ.get("OCTAVO_CACHE_DIR")
    os.environ["OCTAVO_CACHE_DIR"] = str(directory)
    yield directory
    if previous is None:
        os.environ.pop("OCTAVO_CACHE_DIR", None)
    else:
        os.environ["OCTAVO_CACHE_DIR"] = previous

