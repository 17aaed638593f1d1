"""Triton octavo.moe (grouped GEMMs over pairs sorted by expert, block-aligned) against the op's definition.

The unreachable experts of moe_batches hold NaN weights: blocks are formed only for the experts some
token chose, so their weights are never loaded. Tiny shapes: the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from octavo.codegen.triton_backend.moe import align_pairs, moe
from octavo.ir.ops.moe import moe_reference
from tests.codegen.moe_batches import QUANTIZED_TOLERANCE, TOLERANCE, make_moe_batch, reachable_experts_only


def on(device, batch: dict) -> dict:
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in batch.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 13])
def test_float_experts_match_definition(tokens, dtype, device):
    batch = make_moe_batch(tokens, dtype, seed=tokens)
    assert reachable_experts_only(batch)
    result = moe(**on(device, batch)).cpu()
    assert result.dtype == dtype and not result.isnan().any()
    torch.testing.assert_close(result, moe_reference(**batch), **TOLERANCE[dtype])


@pytest.mark.parametrize(("layout", "group_size"), [("w8", None), ("w4", 32)])
def test_quantized_experts_match_definition(layout, group_size, device):
    batch = make_moe_batch(5, layout=layout, group_size=group_size, seed=3)
    result = moe(**on(device, batch)).cpu()
    torch.testing.assert_close(result, moe_reference(**batch), **QUANTIZED_TOLERANCE)


def test_unrounded_weights_and_gelu(device):
    batch = make_moe_batch(6, torch.bfloat16, round_weights=False, activation="gelu_tanh", seed=4)
    torch.testing.assert_close(moe(**on(device, batch)).cpu(), moe_reference(**batch), **TOLERANCE[torch.bfloat16])


def test_alignment_pads_each_expert_to_whole_blocks():
    experts = torch.tensor([3, 0, 3, 3, 1, 0, 3])
    sorted_pairs, block_experts = align_pairs(experts, num_experts=5, block_m=2)
    pad = experts.numel()
    # Expert 0: pairs 1, 5; expert 1: pair 4 and a pad; expert 3: pairs 0, 2, 3, 6; then padding blocks.
    assert sorted_pairs.tolist()[:8] == [1, 5, 4, pad, 0, 2, 3, 6]
    assert block_experts.tolist()[:4] == [0, 1, 3, 3]
    assert set(block_experts.tolist()[4:]) == {5} and set(sorted_pairs.tolist()[8:]) == {pad}
    assert sorted_pairs.numel() == 12  # P + E * (block - 1): room for every expert's last block to be padded
