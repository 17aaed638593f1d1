"""octavo.silu_and_mul against transformers' MLP arithmetic on separate gate/up projections, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import octavo.ir  # registers the ops

octavo = torch.ops.octavo


# 1536 is SmolLM2's intermediate size; 37 and 100 are not multiples of the CPU vector width, where silu computes
# each row's tail with a scalar formula: the op must still equal silu over the gate projection's own tensor.
@pytest.mark.parametrize("intermediate", [1536, 128, 100, 37])
@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_equals_separate_projections_bitwise(intermediate, tokens, dtype):
    torch.manual_seed(intermediate + tokens)
    # What HF computes: act_fn(gate_proj(x)) * up_proj(x), each projection its own contiguous tensor.
    gate, up = (torch.randn(2, 1, tokens, intermediate) * 3).to(dtype)
    expected = F.silu(gate) * up
    merged = torch.cat([gate, up], dim=-1)  # what the merged gate/up projection gives
    result = octavo.silu_and_mul(merged)
    assert result.shape == (1, tokens, intermediate) and result.dtype == dtype
    assert torch.equal(result, expected)


def test_silu_and_mul_does_not_write_its_input():
    x = torch.randn(2, 5, 64)
    before = x.clone()
    octavo.silu_and_mul(x)
    assert torch.equal(x, before)


def test_fake_impl_gives_the_real_shape_and_dtype():
    x = torch.randn(1, 6, 40).to(torch.bfloat16)
    real = octavo.silu_and_mul(x)
    with FakeTensorMode() as mode:
        fake = octavo.silu_and_mul(mode.from_tensor(x))
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype) == ((1, 6, 20), torch.bfloat16)


def test_schema_follows_the_op_contract():
    assert str(octavo.silu_and_mul.default._schema) == "octavo::silu_and_mul(Tensor x) -> Tensor"


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("intermediate", [128, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_and_mul_equals_gemma_mlp_arithmetic_bitwise(approximate, intermediate, dtype):
    torch.manual_seed(intermediate)
    # Gemma: act_fn(gate_proj(x)) * up_proj(x) with act_fn gelu_pytorch_tanh (F.gelu(approximate="tanh")).
    gate, up = (torch.randn(2, 1, 9, intermediate) * 3).to(dtype)
    expected = F.gelu(gate, approximate=approximate) * up
    result = octavo.gelu_and_mul(torch.cat([gate, up], dim=-1), approximate)
    assert result.shape == (1, 9, intermediate) and result.dtype == dtype
    assert torch.equal(result, expected)
