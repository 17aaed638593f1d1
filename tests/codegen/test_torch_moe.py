"""The torch backend's octavo.moe kernel: bit for bit the reference op, never touching an unchosen expert."""

from __future__ import annotations

import pytest
import torch

from octavo.codegen.torch_backend.moe import moe
from octavo.ir.ops.moe import moe_reference
from tests.codegen.moe_batches import make_moe_batch, reachable_experts_only


@pytest.mark.parametrize(("dtype", "layout", "group_size"),
                         [(torch.float32, None, None), (torch.bfloat16, None, None), (torch.float32, "w8", None),
                          (torch.float32, "w8", 32), (torch.bfloat16, "w4", 32)],
                         ids=["fp32", "bf16", "w8-per-channel", "w8-group32", "w4-bf16"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_equals_the_reference_bitwise(dtype, layout, group_size, tokens):
    batch = make_moe_batch(tokens, dtype, layout, group_size, seed=tokens)
    assert reachable_experts_only(batch)
    result = moe(**batch)
    assert not result.isnan().any(), "an expert no token chose was read"
    assert torch.equal(result, moe_reference(**batch))


@pytest.mark.parametrize(("normalize", "round_weights", "activation"),
                         [(False, True, "silu"), (True, False, "silu"), (True, True, "gelu_tanh")])
def test_routing_and_activation_variants(normalize, round_weights, activation):
    batch = make_moe_batch(9, torch.bfloat16, normalize=normalize, round_weights=round_weights,
                           activation=activation, seed=2)
    assert torch.equal(moe(**batch), moe_reference(**batch))
