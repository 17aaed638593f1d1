"""The C++ mixture of experts (octavo_cpu::moe) against the op's definition (octavo::moe).

Batches come from moe_batches.make_moe_batch, whose unreachable experts hold NaN weights: the kernel
must compute only the experts its tokens chose. Routing is exact: the probabilities are ATen's softmax of
ATen's router linear, bitwise the definition's, and the top-k selection must pick the same experts (a
different expert would change a row by far more than the tolerances).
"""

from __future__ import annotations

import pytest
import torch

from octavo.ir.ops.moe import moe_reference
from tests.codegen.moe_batches import QUANTIZED_TOLERANCE, TOLERANCE, make_moe_batch, reachable_experts_only

RANGES = ("octavo_cpu::moe_routing", "octavo_cpu::moe_permutation", "octavo_cpu::moe_experts")


def run_kernel(batch: dict) -> torch.Tensor:
    result = torch.ops.octavo_cpu.moe(**batch)
    assert result.shape == batch["x"].shape and result.dtype == batch["x"].dtype
    assert not result.isnan().any(), "an expert no token chose was read"
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 2, 17, 64])
def test_float_experts_match_definition(tokens, dtype, cpu_kernels):
    batch = make_moe_batch(tokens, dtype, seed=tokens)
    assert reachable_experts_only(batch)
    torch.testing.assert_close(run_kernel(batch), moe_reference(**batch), **TOLERANCE[dtype])


@pytest.mark.parametrize(("layout", "group_size"), [("w8", None), ("w8", 32), ("w4", 32)])
@pytest.mark.parametrize("tokens", [1, 40])
def test_quantized_experts_match_definition(layout, group_size, tokens, cpu_kernels):
    """Few rows take the w8 / w4 GEMVs that read the int8 / 4-bit bytes in place, many the dequantizing GEMM."""
    batch = make_moe_batch(tokens, layout=layout, group_size=group_size, seed=7)
    torch.testing.assert_close(run_kernel(batch), moe_reference(**batch), **QUANTIZED_TOLERANCE)


@pytest.mark.parametrize(("normalize", "round_weights", "activation"),
                         [(False, True, "silu"), (True, False, "silu"), (True, True, "gelu_tanh"),
                          (False, True, "gelu")])
def test_routing_and_activation_variants(normalize, round_weights, activation, cpu_kernels):
    batch = make_moe_batch(12, torch.bfloat16, normalize=normalize, round_weights=round_weights,
                           activation=activation, seed=5)
    torch.testing.assert_close(run_kernel(batch), moe_reference(**batch), **TOLERANCE[torch.bfloat16])


def test_no_tokens(cpu_kernels):
    batch = make_moe_batch(0)
    assert run_kernel(batch).shape == (0, batch["x"].shape[1])


def test_routing_permutation_and_experts_are_timed_apart(cpu_kernels):
    """`octavo bench --profile` reads these three ranges inside the op."""
    batch = make_moe_batch(8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run_kernel(batch)
    names = {event.name for event in profile.events()}
    assert set(RANGES) <= names
