"""The torch backend's linear_w16: float32 matmuls over tiles of the 16-bit weight widened one at a time.

Against the op's definition (the whole weight widened, one float32 linear): the widening is exact and
every output element is a float32 sum of the same K products, in another order when the weight spans
several tiles. Two float32 sums of K products in any orders each lie within gamma_K S of the exact sum,
S = sum_k |x_k w_k|, gamma_K = K u / (1 - K u), u = 2^-24; the bias adds one rounding of the output.
"""

from __future__ import annotations

import pytest
import torch

from octavo.codegen.torch_backend import KERNELS
from octavo.codegen.torch_backend.linear import TILE_BYTES, linear_w16, rows_per_tile

octavo = torch.ops.octavo


def _bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    columns = x.shape[-1]
    gamma = columns * 2**-24 / (1 - columns * 2**-24)
    magnitude = x.abs() @ weight.float().abs().T
    return 2 * gamma * magnitude + 2**-24 * (magnitude + (0 if bias is None else bias.abs()))


# (rows of x, K, N): N spans 1 tile, exactly 2 tiles, and 2 tiles plus a short one.
@pytest.mark.parametrize(("rows", "columns", "tiles"), [(1, 576, 0.5), (7, 512, 2), (3, 1536, 2.3)])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_tiles_compute_the_definition(rows, columns, tiles, weight_dtype, with_bias):
    out = max(1, int(tiles * rows_per_tile(columns)))
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, columns, generator=generator)
    weight = (0.05 * torch.randn(out, columns, generator=generator)).to(weight_dtype)
    bias = torch.randn(out, generator=generator) if with_bias else None
    actual = linear_w16(x, weight, bias)
    expected = octavo.linear_w16(x, weight, bias)
    assert actual.shape == expected.shape == (2, rows, out) and actual.dtype == torch.float32
    assert ((actual - expected).abs() <= _bound(x, weight, bias)).all()


def test_a_tile_of_widened_rows_fits_its_budget():
    for columns in (64, 576, 1536, 8192):
        assert rows_per_tile(columns) * columns * 4 <= TILE_BYTES
    assert rows_per_tile(10**9) == 1


def test_the_backend_runs_it_as_one_opaque_op():
    kernel = KERNELS[octavo.linear_w16.default]
    assert kernel is torch.ops.octavo_torch.linear_w16.default
    x, weight = torch.randn(3, 576), torch.randn(2000, 576).to(torch.bfloat16)
    assert torch.equal(kernel(x, weight, None), linear_w16(x, weight))
