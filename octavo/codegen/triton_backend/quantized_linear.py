"""Triton kernels: octavo.linear_w8 / linear_w4 / linear_fp8 / linear_w16, a matmul that widens weight tiles as it
loads them.

Semantics (octavo.ir.ops.quantized_linear, octavo.ir.ops.linear), x [..., K], weights in the portable
layouts of octavo.ir.quantized_layout: ``out = (x @ W.T + bias).to(x.dtype)`` where W is the weight
dequantized in float32 (w8: ``q * scale[n, k // G]``; w4: ``q * scale[n, g] + offset[n, g]``
with the nibble of byte ``k // 2`` selected by ``k % 2``; fp8: ``q * scale[n]``; w16: the bfloat16 or
float16 weight widened, exactly, to float32, with float32 x). No layout widens the whole weight: each
program widens only the [BLOCK_K, BLOCK_N] slices it multiplies, in registers.
One program computes a [BLOCK_M, BLOCK_N] tile of the output: for each BLOCK_K slice of
K it loads the activations and the quantized weight slice, dequantizes the slice in
float32 and accumulates ``tl.dot`` in float32. Float32 activations keep IEEE float32
products; 16-bit activations (exact in TF32) meet the weight rounded to TF32 (10-bit
mantissa) on tensor cores (see attention_decode.dot_precision). The bias is added in
float32 and the result rounded once to x's dtype.

The embedding lookups (embedding_w8 / embedding_w4) run the reference op: a gather and the
dequantization of the gathered rows, plain torch on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from octavo.codegen.triton_backend.attention_decode import dot_precision

W8, W4, FP8, W16 = 0, 1, 2, 3


@triton.jit
def _quantized_linear_kernel(
    x_ptr, qweight_ptr, scales_ptr, offsets_ptr, bias_ptr, output_ptr,
    num_rows, out_features, in_features, group_size, num_groups,
    x_row_stride, qweight_row_stride, output_row_stride,
    LAYOUT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,  # noqa: N803
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # noqa: N803
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    columns = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_mask = rows < num_rows
    column_mask = columns < out_features
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < in_features
        # Activations [BLOCK_M, BLOCK_K]; columns past K load 0 and add nothing.
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        # The weight slice [BLOCK_K, BLOCK_N] (W transposed): element (k, n) of W[n, k].
        tile_mask = k_mask[:, None] & column_mask[None, :]
        if LAYOUT == 3:
            weight = tl.load(qweight_ptr + columns[None, :] * qweight_row_stride + ks[:, None], mask=tile_mask,
                             other=0.0).to(tl.float32)
        elif LAYOUT == 2:
            q = tl.load(qweight_ptr + columns[None, :] * qweight_row_stride + ks[:, None], mask=tile_mask, other=0.0)
            weight = q.to(tl.float32) * tl.load(scales_ptr + columns, mask=column_mask, other=0.0)[None, :]
        else:
            group_index = columns[None, :] * num_groups + (ks // group_size)[:, None]
            scale = tl.load(scales_ptr + group_index, mask=tile_mask, other=0.0).to(tl.float32)
            if LAYOUT == 0:
                q = tl.load(qweight_ptr + columns[None, :] * qweight_row_stride + ks[:, None], mask=tile_mask,
                            other=0)
                weight = q.to(tl.float32) * scale
            else:
                packed = tl.load(qweight_ptr + columns[None, :] * qweight_row_stride + (ks // 2)[:, None],
                                 mask=tile_mask, other=0)
                nibble = (packed >> ((ks % 2) * 4).to(tl.uint8)[:, None]) & 0x0F
                offset = tl.load(offsets_ptr + group_index, mask=tile_mask, other=0.0).to(tl.float32)
                weight = nibble.to(tl.float32) * scale + offset
        accumulator = tl.dot(x.to(tl.float32), weight, accumulator, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        accumulator += tl.load(bias_ptr + columns, mask=column_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(output_ptr + rows[:, None] * output_row_stride + columns[None, :],
             accumulator.to(output_ptr.dtype.element_ty), mask=row_mask[:, None] & column_mask[None, :])


def linear_w8(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None, group_size: int) -> Tensor:
    """octavo.linear_w8 (see the module docstring)."""
    return _launch(W8, x, qweight, scales, None, bias, group_size)


def linear_w4(x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor, bias: Tensor | None,
              group_size: int) -> Tensor:
    """octavo.linear_w4 (see the module docstring)."""
    return _launch(W4, x, qweight, scales, offsets, bias, group_size)


def linear_fp8(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """octavo.linear_fp8 (see the module docstring)."""
    return _launch(FP8, x, qweight, scales, None, bias, qweight.shape[1])


def linear_w16(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """octavo.linear_w16 (see the module docstring): float32 x against a 16-bit weight."""
    return _launch(W16, x, weight, weight, None, bias, weight.shape[1])


def embedding_w8(qweight: Tensor, scales: Tensor, indices: Tensor, group_size: int, dtype: torch.dtype) -> Tensor:
    """octavo.embedding_w8: the reference op (gather, then dequantize the rows)."""
    return torch.ops.octavo.embedding_w8(qweight, scales, indices, group_size, dtype)


def embedding_w4(qweight: Tensor, scales: Tensor, offsets: Tensor, indices: Tensor, group_size: int,
                 dtype: torch.dtype) -> Tensor:
    """octavo.embedding_w4: the reference op (gather, then dequantize the rows)."""
    return torch.ops.octavo.embedding_w4(qweight, scales, offsets, indices, group_size, dtype)


def _launch(layout: int, x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor | None, bias: Tensor | None,
            group_size: int) -> Tensor:
    in_features = x.shape[-1]
    out_features = qweight.shape[0]
    rows = x.reshape(-1, in_features)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    output = torch.empty((rows.shape[0], out_features), dtype=x.dtype, device=x.device)
    if rows.shape[0] and out_features:
        block_m = 16 if rows.shape[0] <= 16 else 64
        block_n, block_k = 64, 32
        grid = (triton.cdiv(rows.shape[0], block_m), triton.cdiv(out_features, block_n))
        qweight = qweight.contiguous()
        scales = scales.contiguous()
        _quantized_linear_kernel[grid](
            rows, qweight, scales, scales if offsets is None else offsets.contiguous(),
            scales if bias is None else bias.contiguous(), output,
            rows.shape[0], out_features, in_features, group_size, scales.shape[-1] if scales.dim() == 2 else 1,
            rows.stride(0), qweight.stride(0), output.stride(0),
            LAYOUT=layout, HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        )
    return output.reshape(*x.shape[:-1], out_features)
