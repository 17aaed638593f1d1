"""The portable quantized layouts: packing, dequantization by their element formulas, validation."""

from __future__ import annotations

import pytest
import torch

from octavo.ir.quantized_layout import (
    FP8,
    W4,
    W8,
    QuantizedWeight,
    concat_rows,
    pack_int4,
    unpack_int4,
)


def _element_weight(layout: str, q: torch.Tensor, scales, offsets, group_size: int, n: int, k: int) -> float:
    """W[n, k] from the layout's formula, one element at a time (float32 arithmetic, as specified)."""
    if layout == FP8:
        return (q[n, k].to(torch.float32) * scales[n]).item()
    scale = scales[n, k // group_size].to(torch.float32)
    if layout == W8:
        return (q[n, k].to(torch.float32) * scale).item()
    byte = int(q[n, k // 2])
    nibble = byte & 0x0F if k % 2 == 0 else byte >> 4
    return (torch.tensor(float(nibble)) * scale + offsets[n, k // group_size].to(torch.float32)).item()


def test_int4_packing_puts_even_columns_in_low_nibbles():
    values = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]], dtype=torch.uint8)
    packed = pack_int4(values)
    assert packed.tolist() == [[1 | 2 << 4, 15], [7 | 8 << 4, 3 | 12 << 4]]
    assert torch.equal(unpack_int4(packed), values)
    with pytest.raises(ValueError, match="even number of columns"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


@pytest.mark.parametrize(("layout", "group_size", "in_features"), [
    (W8, 16, 40), (W8, 40, 40), (W4, 16, 40), (W4, 32, 40), (FP8, 40, 40)])
def test_dequantize_follows_the_element_formula(layout, group_size, in_features):
    # 40 columns with groups of 16 and 32: the last group of each row is short.
    generator = torch.Generator().manual_seed(0)
    rows = 5
    groups = -(-in_features // group_size)
    offsets = None
    if layout == W8:
        q = torch.randint(-127, 128, (rows, in_features), generator=generator, dtype=torch.int8)
        scales = torch.rand(rows, groups, generator=generator).to(torch.float16)
    elif layout == W4:
        q = pack_int4(torch.randint(0, 16, (rows, in_features), generator=generator, dtype=torch.uint8))
        scales = torch.rand(rows, groups, generator=generator).to(torch.float16)
        offsets = (-torch.rand(rows, groups, generator=generator)).to(torch.float16)
    else:
        q = torch.randn(rows, in_features, generator=generator).to(torch.float8_e4m3fn)
        scales = torch.rand(rows, generator=generator)
    weight = QuantizedWeight(layout, q, scales, offsets, group_size)
    dense = weight.dequantize()
    assert dense.dtype == torch.float32 and dense.shape == (rows, in_features)
    assert weight.in_features == in_features and weight.out_features == rows
    for n in range(rows):
        for k in range(in_features):
            assert dense[n, k].item() == _element_weight(layout, q, scales, offsets, group_size, n, k)


def test_concat_and_take_rows_are_exact_reorderings():
    generator = torch.Generator().manual_seed(1)
    parts = [QuantizedWeight(W4, pack_int4(torch.randint(0, 16, (rows, 64), generator=generator, dtype=torch.uint8)),
                             torch.rand(rows, 2).half(), torch.rand(rows, 2).half(), 32) for rows in (3, 5)]
    merged = concat_rows(parts)
    assert torch.equal(merged.dequantize(), torch.cat([part.dequantize() for part in parts]))
    order = torch.tensor([7, 0, 3, 1, 2, 4, 6, 5])
    assert torch.equal(merged.take_rows(order).dequantize(), merged.dequantize()[order])
    with pytest.raises(ValueError, match="cannot be concatenated"):
        concat_rows([parts[0], QuantizedWeight(W4, parts[1].qweight, parts[1].scales[:, :1], parts[1].offsets[:, :1],
                                               64)])


@pytest.mark.parametrize(("make", "message"), [
    (lambda: QuantizedWeight(W8, torch.zeros(4, 8), torch.ones(4, 1), None, 8), "int8"),
    (lambda: QuantizedWeight(W8, torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 2), None, 8), r"\[4, 1\]"),
    (lambda: QuantizedWeight(W4, torch.zeros(4, 4, dtype=torch.uint8), torch.ones(4, 1), None, 8), "offsets"),
    (lambda: QuantizedWeight(W8, torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1), None, 0), "group_size"),
    (lambda: QuantizedWeight(FP8, torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(4, 1), None, 8), "float32"),
    (lambda: QuantizedWeight("w3", torch.zeros(4, 8), torch.ones(4), None, 8), "unknown quantized layout"),
])
def test_malformed_weights_are_rejected_with_the_reason(make, message):
    with pytest.raises(ValueError, match=message):
        make()
