"""w4's rounding (quantize_rtn.w4_levels, W4Rounding) against its definition with torch.round."""

from __future__ import annotations

import pytest
import torch

from octavo.passes.quantize_rtn import W4Rounding, w4_levels


def reference_levels(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """round_half_even((w - offset) / scale) clamped to 0..15, 0 where the scale is 0 (the docstring's definition)."""
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    levels = torch.round((values - offsets) / safe).clamp(0, 15)
    return torch.where(scales == 0, torch.zeros_like(levels), levels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_levels_round_half_to_even_exactly_as_torch_round(dtype):
    """Every 1/16 step of [-3, 19] (the ties x.5 among them, both ends outside 0..15), random values far outside
    the range, NaN and the infinities; scales of 1, of 0 (level 0) and random, offsets random."""
    generator = torch.Generator().manual_seed(0)
    grid = torch.arange(-48, 305, dtype=dtype) / 16
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 2.5, 3.5, 14.5, 15.5, -0.5], dtype=dtype)
    values = torch.cat([grid, special, torch.randn(4096, generator=generator, dtype=dtype) * 1e4])
    for scales, offsets in [(torch.ones_like(values), torch.zeros_like(values)),
                            (torch.rand(values.shape, generator=generator, dtype=dtype) * 2, torch.randn(
                                values.shape, generator=generator, dtype=dtype))]:
        scales[::7] = 0
        expected = reference_levels(values, scales, offsets)
        actual = w4_levels(values, scales, offsets)
        assert torch.equal(actual.isnan(), expected.isnan())
        assert torch.equal(actual.nan_to_num(-1), expected.nan_to_num(-1))


def test_rounding_writes_into_given_rows_and_dequantizes_to_levels_times_scale_plus_offset():
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(5, 40, generator=generator)
    scales = (torch.rand(40, generator=generator) * 0.1).half()
    offsets = (-torch.rand(40, generator=generator)).half()
    rounding = W4Rounding(scales, offsets)
    rows = torch.full((5, 40), -7.0)
    levels = rounding.levels(values, out=rows)
    assert levels.data_ptr() == rows.data_ptr()
    assert torch.equal(levels, reference_levels(values, scales.float(), offsets.float()))
    dequantized = rounding.dequantized(levels)
    assert torch.equal(dequantized, levels * scales.float() + offsets.float())
