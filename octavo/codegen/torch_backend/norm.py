"""Torch (CPU) kernels for octavo.rms_norm and octavo.fused_add_rms_norm.

The same op sequence as the reference (octavo.ir.ops.norm), so results are bit
for bit those of the decomposed graph; the intermediates this kernel owns are
updated in place instead of being reallocated.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float, multiply_in_float32: bool = False) -> Tensor:
    """Same semantics as octavo.ir.ops.norm.rms_norm (see its docstring)."""
    hidden = x.to(torch.float32)
    scale = hidden.pow(2).mean(-1, keepdim=True)
    scale.add_(eps).rsqrt_()
    # In float32, `hidden` is `x` itself: never write into the caller's tensor.
    hidden = hidden * scale if hidden is x else hidden.mul_(scale)
    if multiply_in_float32:
        return hidden.mul_(weight.to(torch.float32)).to(x.dtype)
    normed = hidden.to(x.dtype)
    if weight.dim() == 1 and normed.dtype == weight.dtype:
        return normed.mul_(weight)
    return weight * normed


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                       multiply_in_float32: bool = False) -> tuple[Tensor, Tensor]:
    """Same semantics as octavo.ir.ops.norm.fused_add_rms_norm (see its docstring)."""
    new_residual = residual + x
    return rms_norm(new_residual, weight, eps, multiply_in_float32), new_residual
