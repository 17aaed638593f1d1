"""The C++ argmax_rows against torch.argmax(dim=-1): the same index in every row, ties and NaN included.

An argmax is exact (no arithmetic): the kernel must return exactly torch's indices, the first of equal
maxima and the first NaN of a row that holds one, whatever the row length's remainder modulo the vector width.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.runtime.sampler import Sampler, SamplingRow, row_argmax
from octavo.runtime.sampling_params import SamplingParams

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check(logits: torch.Tensor) -> None:
    expected = logits.argmax(dim=-1)
    result = torch.ops.octavo_cpu.argmax_rows(logits)
    assert result.dtype == torch.int64
    assert torch.equal(result, expected), (result, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [1, 7, 16, 17, 33, 49152])
def test_random_rows(cpu_kernels, dtype, length):
    generator = torch.Generator().manual_seed(length)
    check((torch.randn(5, length, generator=generator) * 4).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_signed_zeros_infinities_and_nans(cpu_kernels, dtype):
    rows = torch.full((8, 45), -1.0)
    rows[0, [3, 20, 44]] = 2.0                       # equal maxima: the first
    rows[1] = 0.0
    rows[1, 5] = -0.0                                # -0.0 == 0.0: index 0
    rows[2] = float("-inf")                          # all -inf: index 0
    rows[3, 17] = float("inf")
    rows[3, 30] = float("inf")
    rows[4, 40] = float("nan")                       # NaN counts as the largest
    rows[4, 2] = float("inf")
    rows[5, [9, 33]] = float("nan")                  # the first NaN
    rows[6, 44] = 3.0                                # the maximum in the scalar tail
    rows[7, 0] = float("nan")
    check(rows.to(dtype))


def test_strided_rows(cpu_kernels):
    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 100, generator=generator)
    check(wide[:, :61])          # rows that are not contiguous with each other
    check(wide.t()[:40, :6])     # columns of a transposed tensor (copied to rows first)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), length=st.integers(1, 70), levels=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_rows_of_few_distinct_values(cpu_kernels, rows, length, levels, seed):
    """Few distinct values: many ties, and the maximum anywhere, vector body or tail."""
    generator = torch.Generator().manual_seed(seed)
    check(torch.randint(0, levels, (rows, length), generator=generator).float())


def test_sampler_takes_the_kernel_and_chooses_the_same_tokens(cpu_kernels):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=generator)
    logits[1, [10, 250]] = 9.0
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1, 2], [], None) for _ in range(4)]
    output = Sampler(300, eos_token_ids=[0])(logits, rows)
    assert output.token_ids.tolist() == logits.argmax(dim=-1).tolist()
