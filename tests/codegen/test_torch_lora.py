"""The torch backend's LoRA kernel against the op's definition computed exactly, token by token, in float64.

Bound. Each output is y[t] + sum_j B[s, n, j] * (sum_k A[s, j, k] * x[t, k]): float32 products summed over K
and then over the slots' S * R columns (the other slots' columns add exact zeros) and y: with unit roundoff
u = 2^-24, the float32 result is within gamma_{K + S*R + 1} = n*u / (1 - n*u) of the exact value times the
same sum over absolute values (Higham, nested dot products). A bfloat16 output adds its one rounding,
2^-8 of the value (the float32 result may round to the other neighbour of a value near a tie).
"""

from __future__ import annotations

import pytest
import torch

from octavo.codegen.torch_backend.lora import lora

U = 2.0**-24


def exact_and_magnitude(y, x, a, b, slots):
    """float64 [T, N] of the definition and of the same sums over absolute values."""
    rows_x, rows_y = x.reshape(-1, x.shape[-1]).double(), y.reshape(-1, y.shape[-1]).double()
    exact, magnitude = rows_y.clone(), rows_y.abs()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            a64, b64 = a[slot].double(), b[slot].double()
            exact[token] += b64 @ (a64 @ rows_x[token])
            magnitude[token] += b64.abs() @ (a64.abs() @ rows_x[token].abs())
    return exact, magnitude


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("slots", "rank"), [(3, 4), (8, 16)], ids=["every-slot-at-once", "per-segment"])
def test_lora_is_the_definition_within_float32_rounding(dtype, slots, rank):
    """3 x 4 columns are small beside the 64 x 48 linear (one GEMM over all slots: 12 * 112 * 2 <= 3072);
    8 x 16 are not (the segmented definition)."""
    generator = torch.Generator().manual_seed(slots)
    tokens, in_features, out_features = 10, 64, 48
    x = torch.randn(2, tokens // 2, in_features, generator=generator).to(dtype)
    y = torch.randn(2, tokens // 2, out_features, generator=generator).to(dtype)
    a = (torch.randn(slots, rank, in_features, generator=generator) * 0.3).to(dtype)
    b = (torch.randn(slots, out_features, rank, generator=generator) * 0.3).to(dtype)
    token_slots = torch.tensor([0, -1, 2, 2, 1, -1, 0, 1, 2, 0]) % slots
    token_slots[[1, 5]] = -1
    out = lora(y, x, a, b, token_slots)
    assert out.shape == y.shape and out.dtype == dtype
    exact, magnitude = exact_and_magnitude(y, x, a, b, token_slots)
    terms = in_features + slots * rank + 1
    bound = terms * U / (1 - terms * U) * magnitude
    if dtype == torch.bfloat16:
        bound = 2 * bound + 2.0**-8 * exact.abs()
    error = (out.reshape(exact.shape).double() - exact).abs()
    assert bool((error <= bound).all()), float((error - bound).max())
    untouched = token_slots == -1
    assert torch.equal(out.reshape(exact.shape)[untouched], y.reshape(exact.shape)[untouched])


def test_no_tokens():
    x, y = torch.zeros(0, 8), torch.zeros(0, 6)
    out = lora(y, x, torch.ones(2, 2, 8), torch.ones(2, 6, 2), torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0, 6)
