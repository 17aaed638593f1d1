"""Torch (CPU) kernels of the quantized linears: ATen's packed int8/int4 matmuls, or dequantized weights.

The artifact stores the portable layouts (octavo.ir.quantized_layout); at load,
weight_packing turns each quantized linear into one of these ops with weights packed for
it. Each is a torch.library custom op, so a compiled graph sees one opaque call.

- ``octavo_torch::linear_int8pack``: ``aten._weight_int8pack_mm`` (int8 weight [N, K],
  per-output-channel scales in the compute dtype). The activation is cast to the scales'
  dtype (the compute dtype) and the result back to ``x.dtype``.
- ``octavo_torch::linear_int4pack``: ``aten._weight_int4pack_mm_for_cpu`` over
  ``_convert_weight_to_int4pack_for_cpu``'s packing, with ``scales_and_zeros`` [G, N, 2]
  in the compute dtype, where that kernel computes ``(q - 8) * scale + zero``: so
  ``zero = offset + 8 * scale`` turns the portable asymmetric form into its own. It needs
  N % 16 == 0 and K % group_size == 0: rows are padded with zero weights (sliced off the
  result) and the activation with zero columns (which add nothing).
- ``octavo_torch::linear_w8a8``: a w8a8 artifact's linears (int8 weight [N, K], float32 scales [N]):
  ``x`` rounded to int8 in groups of 64 columns, each on a step of its own, the groups' exact
  sums scaled and added (round_to_int8_groups, linear_w8a8).
- ``octavo_torch::linear_dequantized``: ``F.linear`` on a weight dequantized once at load
  into the compute dtype; ``column_scales`` (fp8: the weight holds the exact fp8 values and
  the per-channel scales multiply the result in float32) may be None.

In every op the bias is added in float32 to the float32 result, then rounded to ``x.dtype``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from octavo.ir.quantized_layout import unpack_int4

INT4PACK_GROUP_SIZES = (32, 64, 128, 256)
INT4PACK_ROW_MULTIPLE = 16
WEIGHT_ALIGNMENT = 64


@torch.library.custom_op("octavo_torch::linear_int8pack", mutates_args=())
def linear_int8pack(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """``x`` [..., K] @ (qweight int8 [N, K] * scales [N]).T (+ bias), computed in ``scales.dtype``."""
    flat = x.reshape(-1, x.shape[-1]).to(scales.dtype)
    result = torch.ops.aten._weight_int8pack_mm(flat, qweight, scales)
    return _finish(result, bias, x)


@linear_int8pack.register_fake
def _(x, qweight, scales, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.custom_op("octavo_torch::linear_int4pack", mutates_args=())
def linear_int4pack(x: Tensor, packed: Tensor, scales_and_zeros: Tensor, bias: Tensor | None, group_size: int,
                    out_features: int) -> Tensor:
    """``x`` [..., K] against an int4pack weight of ``out_features`` rows (padded to a multiple of 16)."""
    flat = x.reshape(-1, x.shape[-1]).to(scales_and_zeros.dtype)
    padded_columns = scales_and_zeros.shape[0] * group_size
    if padded_columns != flat.shape[1]:
        flat = F.pad(flat, (0, padded_columns - flat.shape[1]))
    result = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group_size, scales_and_zeros)
    return _finish(result[:, :out_features], bias, x)


@linear_int4pack.register_fake
def _(x, packed, scales_and_zeros, bias, group_size, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


W8A8_GROUP = 64
"""Columns of x that share one int8 step in w8a8's linears (see round_to_int8_groups)."""


def round_to_int8_groups(x: Tensor) -> tuple[Tensor, Tensor]:
    """(xq int8 [M, G, 64], step float32 [M, G, 1]) of ``x`` [M, K], K padded with zeros to G groups of
    W8A8_GROUP columns: step = max|x[m, group]| / 127 and xq = nearest-even(x * (127 / max|x[m, group]|)), each
    rounded to float32 once (0 where the group is all zero).

    The arithmetic of w8a8's activations on every backend: |x - xq * step| <= step / 2.
    """
    x = x.float()
    groups = -(-x.shape[-1] // W8A8_GROUP)
    x = F.pad(x, (0, groups * W8A8_GROUP - x.shape[-1])).reshape(x.shape[0], groups, W8A8_GROUP)
    amax = x.abs().amax(-1, keepdim=True)
    # A true division: `127.0 / amax` would be amax.reciprocal() * 127, rounded twice.
    factor = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(x * factor).clamp(-127, 127).to(torch.int8), amax / 127.0


@torch.library.custom_op("octavo_torch::linear_w8a8", mutates_args=())
def linear_w8a8(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """``x`` [..., K] @ (qweight int8 [N, K] * scales [N]).T (+ bias) with x rounded to int8 in groups of 64
    columns first (round_to_int8_groups): out = (sum over groups of step * sum(xq * q)) * scale + bias, each
    group's sum exact, the rest in float64 then rounded to float32 once (the cpu backend sums the groups in
    float32), then to ``x.dtype``."""
    flat = x.reshape(-1, x.shape[-1])
    xq, step = round_to_int8_groups(flat)
    groups = xq.shape[1]
    q = F.pad(qweight, (0, groups * W8A8_GROUP - qweight.shape[1])).reshape(qweight.shape[0], groups, W8A8_GROUP)
    # float64 holds every product and group sum exactly (|sum| < 2^24).
    dots = torch.einsum("mgk,ngk->mgn", xq.double(), q.double())
    result = (dots * step.double()).sum(1) * scales.double()
    if bias is not None:
        result = result + bias.double()
    return result.float().to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


@linear_w8a8.register_fake
def _(x, qweight, scales, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.custom_op("octavo_torch::linear_dequantized", mutates_args=())
def linear_dequantized(x: Tensor, weight: Tensor, column_scales: Tensor | None, bias: Tensor | None) -> Tensor:
    """``x`` [..., K] @ weight.T in ``weight.dtype``, times ``column_scales`` [N] in float32 (+ bias)."""
    result = F.linear(x.reshape(-1, x.shape[-1]).to(weight.dtype), weight)
    if column_scales is not None:
        result = result.float() * column_scales
    return _finish(result, bias, x)


@linear_dequantized.register_fake
def _(x, weight, column_scales, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _finish(result: Tensor, bias: Tensor | None, x: Tensor) -> Tensor:
    if bias is not None:
        result = result.float() + bias.float()
    return result.to(x.dtype).reshape(*x.shape[:-1], result.shape[-1])


# ---------------------------------------------------------------- packing (at load)


def pack_int8(qweight: Tensor, scales: Tensor, compute_dtype: torch.dtype) -> dict[str, Tensor]:
    """linear_int8pack's weights from the w8 layout with one group per row (scales [N, 1]).

    The int8 weight is used as stored unless it is not 64-byte aligned (a weights file only
    aligns tensors to 8 bytes): ATen's kernel crashes on such a weight with more than one row
    of activations, so it gets a fresh (aligned) copy.
    """
    if not qweight.is_contiguous() or qweight.data_ptr() % WEIGHT_ALIGNMENT:
        qweight = qweight.clone(memory_format=torch.contiguous_format)
    return {"qweight": qweight, "scales": scales.reshape(-1).to(compute_dtype).contiguous()}


def pack_int4(qweight: Tensor, scales: Tensor, offsets: Tensor, group_size: int,
              compute_dtype: torch.dtype) -> dict[str, Tensor]:
    """linear_int4pack's weights from the w4 layout (group_size one of INT4PACK_GROUP_SIZES)."""
    rows, columns = qweight.shape[0], 2 * qweight.shape[1]
    groups = scales.shape[1]
    padded_rows = -(-rows // INT4PACK_ROW_MULTIPLE) * INT4PACK_ROW_MULTIPLE
    values = torch.zeros(padded_rows, groups * group_size, dtype=torch.int32)
    values[:rows, :columns] = unpack_int4(qweight).int()
    zeros = offsets.float() + 8.0 * scales.float()
    scales_and_zeros = torch.zeros(groups, padded_rows, 2, dtype=torch.float32)
    scales_and_zeros[:, :rows, 0] = scales.float().t()
    scales_and_zeros[:, :rows, 1] = zeros.t()
    # Padded rows have scale 0 and zero 0: their weights are 0 whatever q holds.
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    return {"packed": packed, "scales_and_zeros": scales_and_zeros.to(compute_dtype).contiguous()}
