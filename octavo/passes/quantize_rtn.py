"""Round-to-nearest (RTN) quantization of a float weight into the portable layouts.

No calibration: each group's scale comes from the weight's own range. Calibrated schemes
(AWQ, GPTQ) reuse these functions on transformed weights, or build their own values.

- w8: symmetric, ``scale = max|w| / 127`` per group (per row when group_size is None),
  ``q = clamp(round_half_even(w / scale), -127, 127)``; float32 scales.
- w4: asymmetric min/max, ``offset = min(w)``, ``scale = (max(w) - min(w)) / 15`` per
  group, both rounded to the scale dtype first (float16 unless the weight's range needs
  float32), then ``q = clamp(round_half_even((w - offset) / scale), 0, 15)`` with those
  rounded values, so the stored tensors reproduce w within half a step plus the rounding
  of offset. The same form as GGUF's Q4_1.
- fp8: ``scale = max|w| / 448`` per row (448 is float8_e4m3fn's largest finite value),
  ``q = (w / scale)`` cast to float8_e4m3fn (round to nearest even); float32 scales.

All-zero groups get scale 1 (w8, fp8) or 0 (w4, whose offset then holds the value).
"""

from __future__ import annotations

import torch
from torch import Tensor

from octavo.ir.quantized_layout import FP8, FP8_DTYPE, W4, W8, QuantizedWeight, pack_int4

FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
_FLOAT16_SAFE = 6.0e4  # below float16's largest finite value (65504), with room for (max - min)


def quantize_w8(weight: Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8 RTN; group_size None means one scale per output channel."""
    weight = weight.float()
    group = group_size or weight.shape[1]
    grouped = grouped_columns(weight, group)
    scales = grouped.abs().amax(-1) / 127.0
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(grouped / scales.unsqueeze(-1)).clamp(-127, 127)
    qweight = _ungrouped(q, weight.shape[1]).to(torch.int8)
    return QuantizedWeight(W8, qweight, scales.contiguous(), None, group)


def quantize_w4(weight: Tensor, group_size: int, scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Asymmetric 4-bit RTN with min/max range per group (K must be even)."""
    grouped = grouped_columns(weight.float(), group_size)
    scales, offsets = w4_range_params(grouped.amin(-1), grouped.amax(-1), scale_dtype)
    return quantize_w4_on_params(weight, group_size, scales, offsets)


def quantize_w4_on_params(weight: Tensor, group_size: int, scales: Tensor, offsets: Tensor) -> QuantizedWeight:
    """w4 of `weight` [N, K] on given per-group (scales, offsets) [N, num_groups] (their dtype is stored): each
    value rounded to the nearest of its group's 16 levels ``q * scale + offset`` (outside them: the nearest end)."""
    weight = weight.float()
    if weight.shape[1] % 2:
        raise ValueError(f"w4 needs an even number of input features, got {weight.shape[1]}")
    q = w4_levels(grouped_columns(weight, group_size), scales.unsqueeze(-1), offsets.unsqueeze(-1))
    qweight = pack_int4(_ungrouped(q, weight.shape[1]).to(torch.uint8))
    return QuantizedWeight(W4, qweight, scales.contiguous(), offsets.contiguous(), group_size)


def fake_quantize_w4(weight: Tensor, group_size: int, scale_dtype: torch.dtype | None = None) -> Tensor:
    """``quantize_w4(weight, group_size, scale_dtype).dequantize()`` without packing: the float32 weight RTN stores."""
    weight = weight.float()
    grouped = grouped_columns(weight, group_size)
    dequantized = w4_rounded_on_range(grouped, grouped.amin(-1), grouped.amax(-1), scale_dtype)
    return _ungrouped(dequantized, weight.shape[1])


def w4_rounded_on_range(grouped: Tensor, low: Tensor, high: Tensor, scale_dtype: torch.dtype | None) -> Tensor:
    """The float32 values w4 stores for `grouped` [N, G, gs] when each group spans [low, high] ([N, G] each):
    every value rounded to the nearest of the group's 16 levels (values outside the range to its ends)."""
    scales, offsets = w4_range_params(low, high, scale_dtype)
    scales, offsets = scales.unsqueeze(-1), offsets.unsqueeze(-1)
    return w4_levels(grouped, scales, offsets) * scales.float() + offsets.float()


def grid_cuts(steps: int, largest: float) -> tuple[tuple[float, float], ...]:
    """Every (bottom, top) pair of fractions i * largest / (steps - 1), i in 0..steps-1, (0, 0) first: the
    candidate ranges of a group that AWQ's and GPTQ's range searches try, each end of [lo, hi] cut by its
    fraction of hi - lo."""
    fractions = [largest * index / max(steps - 1, 1) for index in range(steps)]
    return tuple((bottom, top) for bottom in fractions for top in fractions)


RANGE_STEPS = 6
RANGE_LARGEST_CUT = 0.25
DEFAULT_RANGE_CUTS = grid_cuts(RANGE_STEPS, RANGE_LARGEST_CUT)


SYMMETRIC_RANGE_CUTS = tuple((cut, cut) for cut in (0.0, 0.025, 0.05, 0.075, 0.1, 0.125))
"""The range shrunk about its middle to 1, 0.95, ..., 0.75 of its width: both ends cut alike."""


def range_cuts_record(error: str, cuts: tuple[tuple[float, float], ...] = DEFAULT_RANGE_CUTS) -> dict:
    """The manifest's description of a range search over `cuts` that keeps the cut of least `error`."""
    fractions = sorted({round(bottom, 4) for bottom, _ in cuts})
    alike = all(bottom == top for bottom, top in cuts)
    return {"cut_from_both_ends_alike" if alike else "cut_from_each_end": fractions,
            "of": "the group's max - min", "least": error}


def w4_scale_dtype(weight: Tensor) -> torch.dtype:
    """float16 for the scales and offsets of `weight` unless its range needs float32."""
    finite16 = bool(weight.abs().max() < _FLOAT16_SAFE) if weight.numel() else True
    return torch.float16 if finite16 else torch.float32


def w4_range_params(low: Tensor, high: Tensor, scale_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(scales, offsets) in `scale_dtype` of groups spanning [low, high]: offset low, step (high - low) / 15."""
    if scale_dtype is None:
        scale_dtype = w4_scale_dtype(torch.stack([low, high])) if low.numel() else torch.float16
    return ((high - low) / 15.0).to(scale_dtype), low.to(scale_dtype)


def w4_levels(values: Tensor, scales: Tensor, offsets: Tensor) -> Tensor:
    """The 4-bit levels q (float, 0..15) of float32 `values` under (broadcast) scales and offsets: the nearest
    ``q * scale + offset``, computed as ``round_half_even((w - offset) / scale)`` clamped; 0 where scale is 0."""
    return W4Rounding(scales, offsets).levels(values)


class W4Rounding:
    """w4_levels and the values they dequantize to, for one set of (broadcast) scales and offsets prepared once.

    Solvers that round many slices of a group on the same parameters (GPTQ, one column at a time) keep
    one of these per group instead of re-deriving the float32 scale, offset and zero-scale mask for
    each slice; ``out`` lets them write into preallocated rows.
    """

    def __init__(self, scales: Tensor, offsets: Tensor) -> None:
        self.scale, self.offset = scales.float(), offsets.float()
        zero = scales == 0
        self.divisor = torch.where(zero, torch.ones_like(self.scale), self.scale)
        self.zero = zero if bool(zero.any()) else None

    def levels(self, values: Tensor, out: Tensor | None = None) -> Tensor:
        """w4_levels(values, scales, offsets), written into `out` when given."""
        q = torch.sub(values, self.offset, out=out) if out is not None else values - self.offset
        # Clamping first makes the rounding exact by adding and removing 2^mantissa_bits: the sum's spacing is
        # 1, so IEEE round-to-nearest-even rounds q exactly as torch.round does, ~20x faster on CPU tensors.
        bias = 1.0 / torch.finfo(q.dtype).eps
        q.div_(self.divisor).clamp_(0, 15).add_(bias).sub_(bias)
        return q if self.zero is None else q.masked_fill_(self.zero, 0.0)

    def dequantized(self, levels: Tensor, out: Tensor | None = None) -> Tensor:
        """``levels * scale + offset`` in float32 (the values the levels stand for), into `out` when given."""
        values = torch.mul(levels, self.scale, out=out) if out is not None else levels * self.scale
        return values.add_(self.offset)


def quantize_fp8(weight: Tensor) -> QuantizedWeight:
    """float8_e4m3fn with one float32 scale per output channel."""
    weight = weight.float()
    scales = weight.abs().amax(1) / FP8_MAX
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    qweight = (weight / scales.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return QuantizedWeight(FP8, qweight, scales.contiguous())


def grouped_columns(weight: Tensor, group_size: int) -> Tensor:
    """[N, K] -> [N, G, group_size]; the last group is padded by repeating its first column.

    Repeating a real value of the group (rather than padding zeros) leaves the group's
    min, max and max|w| unchanged, so a short last group gets the range of its own columns.
    """
    rows, columns = weight.shape
    groups = -(-columns // group_size)
    missing = groups * group_size - columns
    if missing:
        first_of_last = weight[:, (groups - 1) * group_size:(groups - 1) * group_size + 1]
        weight = torch.cat([weight, first_of_last.expand(rows, missing)], dim=1)
    return weight.reshape(rows, groups, group_size)


def _ungrouped(grouped: Tensor, columns: int) -> Tensor:
    return grouped.reshape(grouped.shape[0], -1)[:, :columns]
