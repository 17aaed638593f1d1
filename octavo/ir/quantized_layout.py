"""Portable layouts of quantized weights: what an artifact stores for w8, w4 and fp8 linears.

A linear's float weight W [N, K] (N output features, K input features) is stored as
tensors whose dequantization, in float32, defines the weight the quantized ops compute
with. Groups run along K: group g of row n covers columns ``g * group_size`` up to
``min((g + 1) * group_size, K)``, so the last group of a row may be shorter (K need not be a
multiple of the group size); ``num_groups = ceil(K / group_size)``.

- ``w8``: ``qweight`` int8 [N, K]; ``scales`` [N, num_groups] (float16, bfloat16 or float32);
  ``W[n, k] = float32(qweight[n, k]) * float32(scales[n, k // group_size])``.
  Per-output-channel scales are ``group_size = K`` (one group per row). GGUF Q8_0 is this
  layout with group size 32 and float16 scales.
- ``w4``: ``qweight`` uint8 [N, K / 2] (K even), two 4-bit values per byte: column ``k`` is
  the low nibble of byte ``k // 2`` when k is even and its high nibble when k is odd;
  ``scales`` and ``offsets`` [N, num_groups] (float16, bfloat16 or float32);
  ``W[n, k] = float32(q[n, k]) * float32(scales[n, g]) + float32(offsets[n, g])`` with
  ``q`` in 0..15 and ``g = k // group_size``: the asymmetric form whose offset is the value
  of q = 0. GGUF Q4_1 is this layout with group size 32, float16 scales ``d`` and offsets
  ``m`` (value ``d * q + m``); GGUF Q4_0 (value ``d * (q - 8)``) is it with offset ``-8 d``.
  In both cases the float32 products and sums here are the ones GGUF's own dequantization
  computes (``d * q`` is exact in float32), so the values are identical bit for bit.
- ``fp8``: ``qweight`` float8_e4m3fn [N, K]; ``scales`` float32 [N];
  ``W[n, k] = float32(qweight[n, k]) * scales[n]``.

This module is shared by the frontend (GGUF import), the passes (quantization) and the
backends (packing at load); it only manipulates tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

W8, W4, FP8 = "w8", "w4", "fp8"
LAYOUTS = (W8, W4, FP8)
INT4_LEVELS = 16
FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class QuantizedWeight:
    """One linear's (or embedding's) weight in a portable layout (see the module docstring).

    ``origin`` says where the values came from ("rtn", "gguf Q4_1", ...), for the manifest.
    """

    layout: str
    qweight: Tensor
    scales: Tensor
    offsets: Tensor | None = None
    group_size: int = 0
    origin: str = "rtn"

    def __post_init__(self) -> None:
        check_layout(self)

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        columns = int(self.qweight.shape[1])
        return 2 * columns if self.layout == W4 else columns

    def dequantize(self) -> Tensor:
        """The float32 weight [N, K] these tensors stand for."""
        if self.layout == W8:
            return dequantize_w8(self.qweight, self.scales, self.group_size)
        if self.layout == W4:
            return dequantize_w4(self.qweight, self.scales, self.offsets, self.group_size)
        return dequantize_fp8(self.qweight, self.scales)

    def tensors(self) -> dict[str, Tensor]:
        """The stored tensors by role: qweight, scales and (w4) offsets."""
        tensors = {"qweight": self.qweight, "scales": self.scales}
        if self.offsets is not None:
            tensors["offsets"] = self.offsets
        return tensors

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def take_rows(self, rows: Tensor) -> QuantizedWeight:
        """The weight whose row i is row ``rows[i]`` of this one (an exact reordering)."""
        offsets = None if self.offsets is None else self.offsets[rows].contiguous()
        return QuantizedWeight(self.layout, self.qweight[rows].contiguous(), self.scales[rows].contiguous(),
                               offsets, self.group_size, self.origin)


def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def check_layout(weight: QuantizedWeight) -> None:
    """Raise ValueError naming what is wrong when the tensors do not form the layout."""
    layout, qweight, scales = weight.layout, weight.qweight, weight.scales
    if layout not in LAYOUTS:
        raise ValueError(f"unknown quantized layout {layout!r}; known: {', '.join(LAYOUTS)}")
    expected = {W8: torch.int8, W4: torch.uint8, FP8: FP8_DTYPE}[layout]
    if qweight.dtype != expected or qweight.dim() != 2:
        raise ValueError(f"{layout} qweight must be a 2-D {expected} tensor, got {qweight.dtype} {list(qweight.shape)}")
    if layout == FP8:
        if scales.dtype != torch.float32 or list(scales.shape) != [qweight.shape[0]]:
            raise ValueError(f"fp8 scales must be float32 [{qweight.shape[0]}], "
                             f"got {scales.dtype} {list(scales.shape)}")
        return
    if weight.group_size <= 0:
        raise ValueError(f"{layout} group_size must be positive, got {weight.group_size}")
    groups = num_groups(weight.in_features, weight.group_size)
    tensors = [("scales", scales)] + ([("offsets", weight.offsets)] if layout == W4 else [])
    for role, tensor in tensors:
        if tensor is None or tensor.dtype not in SCALE_DTYPES or list(tensor.shape) != [qweight.shape[0], groups]:
            described = None if tensor is None else f"{tensor.dtype} {list(tensor.shape)}"
            raise ValueError(f"{layout} {role} must be a float tensor [{qweight.shape[0]}, {groups}] "
                             f"(group size {weight.group_size}), got {described}")


def expand_groups(per_group: Tensor, group_size: int, in_features: int) -> Tensor:
    """[N, num_groups] -> [N, K]: each group's value repeated over its columns, as float32."""
    return per_group.float().repeat_interleave(group_size, dim=1)[:, :in_features]


def pack_int4(values: Tensor) -> Tensor:
    """uint8 [N, K] of values 0..15 (K even) -> uint8 [N, K / 2]: even columns low nibbles, odd high."""
    if values.shape[-1] % 2:
        raise ValueError(f"w4 packing needs an even number of columns, got {values.shape[-1]}")
    values = values.to(torch.uint8)
    return values[:, 0::2] | (values[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [N, K / 2] -> uint8 [N, K] of values 0..15 (the inverse of pack_int4)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequantize_w8(qweight: Tensor, scales: Tensor, group_size: int) -> Tensor:
    return qweight.float() * expand_groups(scales, group_size, qweight.shape[1])


def dequantize_w4(qweight: Tensor, scales: Tensor, offsets: Tensor, group_size: int) -> Tensor:
    in_features = 2 * qweight.shape[1]
    # Multiply, then add, each rounded to float32: GGUF's dequantization does the same two steps.
    scaled = unpack_int4(qweight).float() * expand_groups(scales, group_size, in_features)
    return scaled + expand_groups(offsets, group_size, in_features)


def gather_rows_w8(qweight: Tensor, scales: Tensor, indices: Tensor, group_size: int, dtype: torch.dtype) -> Tensor:
    """Rows `indices` of a w8 table [V, H], dequantized in float32 and rounded to `dtype`: [*indices.shape, H]."""
    flat = indices.reshape(-1)
    return dequantize_w8(qweight[flat], scales[flat], group_size).to(dtype).reshape(*indices.shape, -1)


def gather_rows_w4(qweight: Tensor, scales: Tensor, offsets: Tensor, indices: Tensor, group_size: int,
                   dtype: torch.dtype) -> Tensor:
    """Rows `indices` of a w4 table [V, H], dequantized in float32 and rounded to `dtype`: [*indices.shape, H]."""
    flat = indices.reshape(-1)
    values = dequantize_w4(qweight[flat], scales[flat], offsets[flat], group_size)
    return values.to(dtype).reshape(*indices.shape, -1)


def dequantize_fp8(qweight: Tensor, scales: Tensor) -> Tensor:
    return qweight.float() * scales.float().unsqueeze(1)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """The row concatenation of weights of one layout, group size and scale dtype (exact)."""
    first = weights[0]
    for weight in weights[1:]:
        if (weight.layout, weight.group_size, weight.in_features, weight.scales.dtype) != (
                first.layout, first.group_size, first.in_features, first.scales.dtype):
            raise ValueError("quantized weights of different layouts, group sizes, in_features or scale "
                             "dtypes cannot be concatenated")
    offsets = None if first.offsets is None else torch.cat([w.offsets for w in weights])
    origins = sorted({weight.origin for weight in weights})
    return QuantizedWeight(first.layout, torch.cat([w.qweight for w in weights]),
                           torch.cat([w.scales for w in weights]), offsets, first.group_size, "+".join(origins))
