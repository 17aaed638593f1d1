"""octavo.lora against its definition written out token by token: each token gets its own adapter's update."""

from __future__ import annotations

import torch

from octavo.ir.ops.lora import lora_reference


def per_token(y, x, lora_a, lora_b, slots):
    rows = []
    for t in range(x.shape[0]):
        update = lora_b[slots[t]].double() @ (lora_a[slots[t]].double() @ x[t].double()) if slots[t] >= 0 else 0
        rows.append(y[t].double() + update)
    return torch.stack(rows)


def random_case(tokens=7, k=24, n=40, slots=3, rank=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, n, generator=g), torch.randn(tokens, k, generator=g),
            torch.randn(slots, rank, k, generator=g), torch.randn(slots, n, rank, generator=g))


def test_each_token_gets_its_adapters_update():
    y, x, a, b = random_case()
    slots = torch.tensor([2, -1, 0, 2, 1, -1, 0])
    out = torch.ops.octavo.lora(y, x, a, b, slots)
    torch.testing.assert_close(out.double(), per_token(y, x, a, b, slots.tolist()), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], y[1]) and torch.equal(out[5], y[5])  # no adapter: y as it was


def test_leading_dims_and_16_bit_outputs():
    y, x, a, b = random_case(tokens=5)
    slots = torch.tensor([0, 1, 1, -1, 2])
    out = lora_reference(y.unsqueeze(0).bfloat16(), x.unsqueeze(0).bfloat16(), a.bfloat16(), b.bfloat16(), slots)
    assert out.shape == (1, 5, 40) and out.dtype == torch.bfloat16
    expected = per_token(y.bfloat16(), x.bfloat16(), a.bfloat16(), b.bfloat16(), slots.tolist())
    # float32 sums of bf16 products, then one rounding to bf16: within one bf16 ulp of the exact value.
    torch.testing.assert_close(out[0].double(), expected, rtol=2**-8, atol=1e-3)
