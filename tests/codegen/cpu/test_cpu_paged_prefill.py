"""Prefill with bf16 queries over a bf16 cache (octavo_cpu::paged_attention) against the op's definition.

On a CPU with AVX512_BF16 these calls run the bf16 prefill kernel; elsewhere (AVX2, the portable
build, ``ATEN_CPU_CAPABILITY=avx2``) the float kernel, which meets the same bound with room to spare.

The bound, from the arithmetic. Queries and cached keys are bf16 numbers, so q . k is a sum of exact
products in float32, as in the reference. The only extra rounding is that of the softmax weights
p_j = exp(s_j - m) to bf16 before they multiply V: p~_j = p_j (1 + d_j) with |d_j| <= u = 2^-8 (bf16's
unit roundoff), while the normaliser l = sum_j p_j is summed from the unrounded float32 weights. So the
kernel's float32 result differs from the exact one by

    |sum_j (p~_j - p_j) v_j / l| <= u * sum_j w_j |v_j| =: u * A,   w_j = p_j / l (the attention weights),

plus float32 rounding (sums of at most a few hundred terms, exp within 20 ulps: far below 2^-12 * A).
Both results are then rounded to bf16 (relative u each), so per element

    |out - ref| <= (u + 2^-12) * A + u * (|out| + |ref|).

A is the reference op's output for |v| in place of v (weights are non-negative).
"""

from __future__ import annotations

import pytest
import torch

from octavo.ir.ops.attention import paged_attention as reference_op
from tests.codegen.paged_batches import copy_batch, make_batch

BF16_UNIT_ROUNDOFF = 2.0**-8
FLOAT32_SLACK = 2.0**-12

# (context length, query length): whole prompts ending on and just past a key tile (64 keys) and a block
# (16), prompt chunks over a cached context, and a decode in the same step.
PROMPTS = [(64, 64), (65, 65), (129, 129), (200, 70), (97, 33), (48, 1)]


def weighted_magnitude(batch: dict) -> torch.Tensor:
    """A = sum_j w_j |v_j| per output element: the reference in float32 with |v| as the values."""
    magnitude = copy_batch(batch)
    for name in ("query", "key", "value", "key_cache", "value_cache"):
        magnitude[name] = magnitude[name].float()
    magnitude["value"] = magnitude["value"].abs()
    magnitude["value_cache"] = magnitude["value_cache"].abs()
    return reference_op(**magnitude)


def assert_within_bf16_weight_rounding(batch: dict) -> None:
    rows = int(batch["query_start_loc"][-1])
    magnitude = weighted_magnitude(batch)[:rows]
    kernel_batch, reference_batch = copy_batch(batch), copy_batch(batch)
    output = torch.ops.octavo_cpu.paged_attention(**kernel_batch)[:rows].float()
    expected = reference_op(**reference_batch)[:rows].float()
    assert not output.isnan().any()
    bound = (BF16_UNIT_ROUNDOFF + FLOAT32_SLACK) * magnitude + BF16_UNIT_ROUNDOFF * (output.abs() + expected.abs())
    excess = (output - expected).abs() - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} elements off by more than the bound, worst by {excess.max()}"
    for name in ("key_cache", "value_cache"):
        assert torch.equal(kernel_batch[name].view(torch.uint8), reference_batch[name].view(torch.uint8)), name


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8], ids=["gqa1", "gqa3", "gqa8"])
def test_bf16_prefill_within_weight_rounding(group, head_dim, cpu_kernels):
    num_kv_heads = 2 if group < 8 else 1
    batch = make_batch(PROMPTS, group * num_kv_heads, num_kv_heads, head_dim, dtype=torch.bfloat16,
                       seed=group + head_dim, num_padding=3)
    assert_within_bf16_weight_rounding(batch)


@pytest.mark.parametrize(("window", "block_size", "group"), [(40, 16, 3), (64, 8, 5), (7, 32, 1)],
                         ids=["window-40", "window-64-gqa5", "window-7-block-32"])
def test_bf16_prefill_sliding_window(window, block_size, group, cpu_kernels):
    """Windows shorter than and as long as a key tile (64 keys), one shorter than a block; gqa5: items of 95 rows."""
    batch = make_batch([(129, 129), (200, 70), (30, 30), (90, 1)], 2 * group, 2, 64, block_size=block_size,
                       dtype=torch.bfloat16, seed=window, sliding_window=window)
    assert_within_bf16_weight_rounding(batch)


def test_bf16_prefill_with_shared_prefix(cpu_kernels):
    """Prompt chunks whose cached context lies in blocks other sequences share (prefix caching)."""
    batch = make_batch([(150, 40), (180, 100), (140, 1)], 9, 3, 64, dtype=torch.bfloat16, shared_blocks=8, seed=2)
    assert_within_bf16_weight_rounding(batch)
