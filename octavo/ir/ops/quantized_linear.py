"""octavo::linear_w8, linear_w4, linear_fp8 and embedding_w8, embedding_w4: ops over quantized weights.

Each op computes exactly what the float op computes on the dequantized weight: the weight
tensors are in one of the portable layouts of octavo.ir.quantized_layout (read its
docstring for the packing), dequantized to float32, and

- ``linear_*(x, ...)``: ``x`` [..., K] (any float dtype, any leading dims) ->
  ``(x.float32 @ W.T + bias.float32).to(x.dtype)``, [..., N]: the matmul, the bias add and
  the accumulation in float32, one rounding to ``x.dtype`` at the end;
- ``embedding_*(..., indices, ..., dtype)``: ``indices`` int64 of any shape ->
  ``W[indices].to(dtype)``, shape ``indices.shape + [K]`` (the rows are dequantized in
  float32, then rounded once to ``dtype``).

Backends may compute differently (packed weights, reduced-precision activations) within
the tolerances their tests state; the reference implementations here are the definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from octavo.ir.quantized_layout import dequantize_fp8, dequantize_w4, dequantize_w8, gather_rows_w4, gather_rows_w8


@torch.library.custom_op("octavo::linear_w8", mutates_args=())
def linear_w8(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None, group_size: int) -> Tensor:
    """Linear over an int8 weight with group-wise (or per-output-channel) scales.

    ``qweight`` int8 [N, K]; ``scales`` [N, ceil(K / group_size)] (float16/bfloat16/float32);
    ``W[n, k] = qweight[n, k] * scales[n, k // group_size]`` in float32 (group_size = K:
    one scale per output channel); ``bias`` [N] or None. See the module docstring for the result.
    """
    return linear_reference(x, dequantize_w8(qweight, scales, group_size), bias)


@linear_w8.register_fake
def _(x, qweight, scales, bias, group_size):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.custom_op("octavo::linear_w4", mutates_args=())
def linear_w4(x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor, bias: Tensor | None,
              group_size: int) -> Tensor:
    """Linear over a group-wise asymmetric 4-bit weight.

    ``qweight`` uint8 [N, K / 2]: column k is the low nibble of byte k // 2 for even k, the
    high nibble for odd k (values q in 0..15); ``scales``, ``offsets`` [N, ceil(K / group_size)];
    ``W[n, k] = q[n, k] * scales[n, g] + offsets[n, g]`` in float32 with ``g = k // group_size``
    (the last group of a row may be shorter than group_size); ``bias`` [N] or None.
    """
    return linear_reference(x, dequantize_w4(qweight, scales, offsets, group_size), bias)


@linear_w4.register_fake
def _(x, qweight, scales, offsets, bias, group_size):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.custom_op("octavo::linear_fp8", mutates_args=())
def linear_fp8(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """Linear over a float8_e4m3fn weight with per-output-channel float32 scales.

    ``qweight`` float8_e4m3fn [N, K]; ``scales`` float32 [N]; ``W[n, k] = qweight[n, k] * scales[n]``
    in float32; ``bias`` [N] or None.
    """
    return linear_reference(x, dequantize_fp8(qweight, scales), bias)


@linear_fp8.register_fake
def _(x, qweight, scales, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.custom_op("octavo::embedding_w8", mutates_args=())
def embedding_w8(qweight: Tensor, scales: Tensor, indices: Tensor, group_size: int, dtype: torch.dtype) -> Tensor:
    """Embedding lookup in an int8 table (rows are tokens): the w8 layout of linear_w8, [V, H]."""
    return gather_rows_w8(qweight, scales, indices, group_size, dtype)


@embedding_w8.register_fake
def _(qweight, scales, indices, group_size, dtype):
    return qweight.new_empty((*indices.shape, qweight.shape[1]), dtype=dtype)


@torch.library.custom_op("octavo::embedding_w4", mutates_args=())
def embedding_w4(qweight: Tensor, scales: Tensor, offsets: Tensor, indices: Tensor, group_size: int,
                 dtype: torch.dtype) -> Tensor:
    """Embedding lookup in a 4-bit table (rows are tokens): the w4 layout of linear_w4, [V, H]."""
    return gather_rows_w4(qweight, scales, offsets, indices, group_size, dtype)


@embedding_w4.register_fake
def _(qweight, scales, offsets, indices, group_size, dtype):
    return qweight.new_empty((*indices.shape, 2 * qweight.shape[1]), dtype=dtype)


def linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The definition: ``x`` and ``bias`` in float32 against the float32 weight, rounded to x.dtype once."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"quantized linear: input has {x.shape[-1]} features, the weight {weight.shape[1]}")
    result = F.linear(x.float(), weight, None if bias is None else bias.float())
    return result.to(x.dtype)
