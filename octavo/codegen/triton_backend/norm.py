"""Triton kernels: octavo.rms_norm and octavo.fused_add_rms_norm (a block of rows per program).

Semantics (HF LlamaRMSNorm), x [..., H], weight [H]:
``h = x.float(); h = h * rsqrt(mean(h * h, -1) + eps); out = weight * h.to(x.dtype)``,
the statistics in float32 and the final multiply rounded once to the
output dtype (torch's promotion of weight and x); with ``multiply_in_float32``
``out = (h * weight.float()).to(x.dtype)`` (Gemma, OLMo 2). fused_add_rms_norm first
forms ``new_residual = residual + x`` rounded to x's dtype, returns
``(rms_norm(new_residual), new_residual)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from octavo.codegen.triton_backend.availability import rows_per_program


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, output_ptr, new_residual_ptr,
    x_row_stride, residual_row_stride, output_row_stride, new_residual_row_stride,
    num_rows, hidden_size, eps,
    ADD_RESIDUAL: tl.constexpr, MULTIPLY_IN_FLOAT32: tl.constexpr,  # noqa: N803
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,  # noqa: N803
):
    # This program's [BLOCK_R, BLOCK_H] tile: BLOCK_R whole rows.
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    columns = tl.arange(0, BLOCK_H)
    mask = (rows < num_rows)[:, None] & (columns < hidden_size)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + columns[None, :], mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # The residual add, rounded to x's dtype as the unfused graph rounds it, and stored.
        residual = tl.load(residual_ptr + rows[:, None] * residual_row_stride + columns[None, :], mask=mask,
                           other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + rows[:, None] * new_residual_row_stride + columns[None, :], x, mask=mask)
    # Mean of squares per row in float32 (padding columns load 0 and add nothing).
    hidden = x.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(hidden * hidden, axis=1, keep_dims=True) / hidden_size + eps)
    # Normalize, round to x's dtype (unless the weight multiplies in float32), then scale by the weight and
    # round once to the output dtype.
    if MULTIPLY_IN_FLOAT32:
        normed = hidden * inverse_rms
    else:
        normed = (hidden * inverse_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + columns, mask=columns < hidden_size, other=0.0).to(tl.float32)
    tl.store(output_ptr + rows[:, None] * output_row_stride + columns[None, :],
             (weight[None, :] * normed).to(output_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float, multiply_in_float32: bool = False) -> Tensor:
    """octavo.rms_norm (see the module docstring)."""
    return _launch(x, None, weight, eps, multiply_in_float32)[0]


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                       multiply_in_float32: bool = False) -> tuple[Tensor, Tensor]:
    """octavo.fused_add_rms_norm: returns (rms_norm(residual + x), residual + x)."""
    return _launch(x, residual, weight, eps, multiply_in_float32)


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
            multiply_in_float32: bool) -> tuple[Tensor, Tensor | None]:
    hidden_size = x.shape[-1]
    rows_x = _rows(x)
    dtype = x.dtype if multiply_in_float32 else torch.result_type(weight, x)
    output = torch.empty(x.shape, dtype=dtype, device=x.device)
    new_residual = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows_residual = rows_x if residual is None else _rows(residual.expand(x.shape))
    num_rows = rows_x.shape[0]
    if num_rows == 0:
        return output, new_residual
    block_h = triton.next_power_of_2(hidden_size)
    block_r = rows_per_program(block_h, num_rows)
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        rows_x, rows_residual, weight.contiguous(), output, output if new_residual is None else new_residual,
        rows_x.stride(0), rows_residual.stride(0), hidden_size, hidden_size,
        num_rows, hidden_size, eps,
        ADD_RESIDUAL=residual is not None, MULTIPLY_IN_FLOAT32=multiply_in_float32, BLOCK_R=block_r, BLOCK_H=block_h,
    )
    return output, new_residual


def _rows(tensor: Tensor) -> Tensor:
    """A [rows, H] view with unit column stride (a copy only when no such view exists)."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
