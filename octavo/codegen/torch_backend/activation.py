"""Torch (CPU) kernels for octavo.silu_and_mul and octavo.gelu_and_mul."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def silu_and_mul(x: Tensor) -> Tensor:
    """Same semantics as octavo.ir.ops.activation.silu_and_mul (see its docstring).

    silu runs on a contiguous gate half (as in the reference, so it walks the
    layout the unfused gate projection had); its fresh result then takes the
    multiply in place.
    """
    half = x.shape[-1] // 2
    activated = F.silu(x[..., :half].contiguous())
    return activated.mul_(x[..., half:])


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """Same semantics as octavo.ir.ops.activation.gelu_and_mul (see its docstring), as silu_and_mul is computed."""
    half = x.shape[-1] // 2
    activated = F.gelu(x[..., :half].contiguous(), approximate=approximate)
    return activated.mul_(x[..., half:])
