"""Prefills through ATen's flash attention inside octavo_cpu::paged_attention, against the op's definition.

A prefill (two or more query tokens) may be attended by aten::_scaled_dot_product_flash_attention_for_cpu instead of
the paged prefill kernel: a whole prompt from its own rows, a prompt chunk from its cached rows copied out of the
pool plus its new ones, under an additive causal mask. By default this happens for bf16 on CPUs with AMX-BF16;
with OCTAVO_CPU_PREFILL_ATTENTION=aten for every float dtype, which these tests set so that the path is checked
on AVX-512 machines without AMX too. Only the AVX-512 build has the path (ATen's own kernels under a lower
ATEN_CPU_CAPABILITY fail on AMX CPUs): the AVX2 and portable builds must call ATen zero times and meet the same
bounds with the paged kernels. The same step's decodes stay on the paged kernels, and the results of both land
in one output.

Bounds, from the arithmetic:
- bf16: the same as the paged bf16 prefill kernel's (test_cpu_paged_prefill): ATen's kernel also sums exact
  bf16 products in float32, rounds the softmax weights to bf16 before they multiply V while summing the
  normaliser from the float32 weights, and rounds the result to bf16 once; the mask adds 0 or -inf, exactly.
- float32: both sides sum the same float32 terms in different orders (at most n u = 200 * 2^-24 < 2^-16
  relative to A = sum_j w_j |v_j|) and ATen's exp is accurate to 2^-20 relative (so the weights to 2^-19):
  |out - ref| <= 2^-15 * A + 2^-20 * |ref|, with room to spare.
"""

from __future__ import annotations

import pytest
import torch

from octavo.ir.ops.attention import paged_attention as reference_op
from tests.codegen.cpu.test_cpu_paged_prefill import assert_within_bf16_weight_rounding, weighted_magnitude
from tests.codegen.paged_batches import copy_batch, make_batch

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
ENV = "OCTAVO_CPU_PREFILL_ATTENTION"

# Whole prompts (64 and 65 tokens: a key tile and one past it; 129), prompt chunks over 130 and 16 cached tokens
# (a chunk starting inside a block, one starting on a block boundary), and a decode.
MIXED = [(64, 64), (129, 129), (200, 70), (65, 65), (49, 33), (48, 1)]


def aten_calls(batch: dict) -> int:
    """How many times one call of the op runs ATen's flash attention."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        torch.ops.octavo_cpu.paged_attention(**copy_batch(batch))
    return sum(event.count for event in profile.key_averages() if event.key == FLASH)


def expected_calls(cpu_kernels, prefills: int) -> int:
    """The prefills ATen attends with OCTAVO_CPU_PREFILL_ATTENTION=aten: every one in the AVX-512 build, none else."""
    return prefills if cpu_kernels.target.level == "avx512" else 0


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8], ids=["gqa1", "gqa3", "gqa8"])
def test_bf16_prefills_within_weight_rounding(group, head_dim, cpu_kernels, monkeypatch):
    monkeypatch.setenv(ENV, "aten")
    num_kv_heads = 2 if group < 8 else 1
    batch = make_batch(MIXED, group * num_kv_heads, num_kv_heads, head_dim, dtype=torch.bfloat16,
                       seed=10 + group + head_dim, num_padding=3)
    assert aten_calls(batch) == expected_calls(cpu_kernels, 5)
    assert_within_bf16_weight_rounding(batch)


def test_chunks_over_a_shared_prefix(cpu_kernels, monkeypatch):
    """Chunks whose cached context lies in blocks other sequences share (prefix caching), with a decode."""
    monkeypatch.setenv(ENV, "aten")
    batch = make_batch([(150, 40), (180, 100), (140, 1)], 9, 3, 64, dtype=torch.bfloat16, shared_blocks=8, seed=2)
    assert aten_calls(batch) == expected_calls(cpu_kernels, 2)
    assert_within_bf16_weight_rounding(batch)


def test_a_step_of_prefills_only(cpu_kernels, monkeypatch):
    """No sequence is left to the paged kernels: the result comes from ATen alone; padding rows are zero."""
    monkeypatch.setenv(ENV, "aten")
    batch = make_batch([(17, 17), (100, 100), (2, 2), (90, 20)], 9, 3, 64, dtype=torch.bfloat16, seed=4,
                       num_padding=5)
    assert aten_calls(batch) == expected_calls(cpu_kernels, 4)
    assert_within_bf16_weight_rounding(batch)
    output = torch.ops.octavo_cpu.paged_attention(**copy_batch(batch))
    assert output.is_contiguous() and output.dtype == torch.bfloat16
    assert torch.equal(output[-5:], torch.zeros_like(output[-5:]))


@pytest.mark.parametrize("group", [1, 3], ids=["gqa1", "gqa3"])
def test_float32_prefills(group, cpu_kernels, monkeypatch):
    monkeypatch.setenv(ENV, "aten")
    batch = make_batch(MIXED, 2 * group, 2, 64, seed=20 + group, num_padding=2)
    assert aten_calls(batch) == expected_calls(cpu_kernels, 5)
    rows = int(batch["query_start_loc"][-1])
    output = torch.ops.octavo_cpu.paged_attention(**copy_batch(batch))[:rows]
    expected = reference_op(**copy_batch(batch))[:rows]
    bound = 2.0**-15 * weighted_magnitude(batch)[:rows] + 2.0**-20 * expected.abs()
    assert ((output - expected).abs() <= bound).all()


def test_what_stays_on_the_paged_kernels(cpu_kernels, monkeypatch):
    """Sliding windows, quantized caches and OCTAVO_CPU_PREFILL_ATTENTION=paged never call ATen's kernel."""
    monkeypatch.setenv(ENV, "aten")
    windowed = make_batch([(129, 129), (64, 64)], 6, 2, 64, dtype=torch.bfloat16, seed=5, sliding_window=40)
    quantized = make_batch([(129, 129)], 6, 2, 64, dtype=torch.bfloat16, cache_dtype=torch.int8, seed=6)
    assert aten_calls(windowed) == 0 and aten_calls(quantized) == 0
    monkeypatch.setenv(ENV, "paged")
    assert aten_calls(make_batch(MIXED, 6, 2, 64, dtype=torch.bfloat16, seed=7)) == 0


def test_an_unknown_mode_is_an_error_that_names_the_variable(cpu_kernels, monkeypatch):
    monkeypatch.setenv(ENV, "fast")
    batch = make_batch([(64, 64)], 6, 2, 64, dtype=torch.bfloat16, seed=8)
    with pytest.raises(RuntimeError, match="OCTAVO_CPU_PREFILL_ATTENTION must be auto, aten or paged"):
        torch.ops.octavo_cpu.paged_attention(**copy_batch(batch))
