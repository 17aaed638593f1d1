"""Paged attention over int8 / fp8 caches with per-token, per-head scales: reference op and torch kernel.

The reference op must store each written (token, kv head) vector as ``x / s`` rounded (int8,
clamped to +-127) or cast (fp8) with ``s = max|x| / 127`` (int8) or ``/ 448`` (fp8), and read
every cached vector as ``value * s`` in float32: so its output equals the float op's on the
restored keys and values, bit for bit. The torch kernel must write the same bytes and give
the reference's output within float32 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from octavo.codegen.torch_backend.attention import paged_attention as torch_kernel
from tests.codegen.test_torch_attention import DECODES, MIXED, copy_batch, make_batch

reference_op = torch.ops.octavo.paged_attention.default
MAXIMUM = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
DTYPES = [torch.int8, torch.float8_e4m3fn]


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, written out: one scale per vector of the last dim, 1 for an all-zero vector."""
    largest = x.float().abs().amax(-1)
    scale = torch.where(largest > 0, largest / MAXIMUM[dtype], torch.ones_like(largest))
    scaled = x.float() / scale.unsqueeze(-1)
    values = scaled.round().clamp(-127, 127).to(torch.int8) if dtype == torch.int8 else scaled.to(dtype)
    return values, scale


def restore(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale.unsqueeze(-1)


def quantized_batch(batch: dict, dtype: torch.dtype) -> dict:
    quantized = copy_batch(batch)
    for name in ("key", "value"):
        values, scale = quantize(batch[f"{name}_cache"], dtype)
        quantized[f"{name}_cache"], quantized[f"{name}_scale_cache"] = values, scale
    return quantized


def restored_batch(batch: dict, dtype: torch.dtype) -> dict:
    """The float batch whose caches and new keys/values hold the restored quantized values."""
    restored = copy_batch(batch)
    for name in ("key", "value"):
        restored[f"{name}_cache"] = restore(*quantize(batch[f"{name}_cache"], dtype))
        restored[name] = restore(*quantize(batch[name], dtype))
    return restored


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("shapes", [DECODES, MIXED], ids=["decodes", "mixed"])
def test_reference_writes_quantized_vectors_and_attends_over_restored_ones(shapes, dtype):
    batch = make_batch(shapes, num_heads=6, num_kv_heads=2, head_dim=64, num_padding=1)
    quantized = quantized_batch(batch, dtype)
    output = reference_op(**quantized)
    restored = restored_batch(batch, dtype)
    expected = reference_op(**restored)
    rows = int(batch["query_start_loc"][-1])
    assert torch.equal(output[:rows], expected[:rows])
    slots = batch["slot_mapping"][batch["slot_mapping"] >= 0]
    for name in ("key", "value"):
        values, scale = quantize(batch[name][:rows], dtype)
        cache = quantized[f"{name}_cache"].view(-1, 2, 64)
        assert torch.equal(cache[slots].view(torch.int8), values.view(torch.int8))
        assert torch.equal(quantized[f"{name}_scale_cache"].view(-1, 2)[slots], scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("shapes", [DECODES, MIXED, [(50, 9), (37, 16)]], ids=["decodes", "mixed", "chunks"])
def test_torch_kernel_matches_the_reference(shapes, dtype):
    batch = quantized_batch(make_batch(shapes, num_heads=8, num_kv_heads=2, head_dim=64, num_padding=2), dtype)
    kernel_batch, reference_batch = copy_batch(batch), copy_batch(batch)
    output = torch_kernel(**kernel_batch)
    expected = reference_op(**reference_batch)
    rows = int(batch["query_start_loc"][-1])
    torch.testing.assert_close(output[:rows], expected[:rows], atol=2e-5, rtol=2e-5)
    for name in ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache"):
        assert torch.equal(kernel_batch[name].view(torch.int8) if "scale" not in name else kernel_batch[name],
                           reference_batch[name].view(torch.int8) if "scale" not in name else reference_batch[name])


def test_decodes_sharing_prefix_blocks(one_thread):
    # Float32 decodes sharing leading blocks take the cascade path on float caches; quantized ones must not.
    batch = make_batch([(40, 1), (40, 1), (40, 1)], num_heads=4, num_kv_heads=2, head_dim=64)
    batch["block_tables"][1:, :2] = batch["block_tables"][0, :2]
    quantized = quantized_batch(batch, torch.int8)
    torch.testing.assert_close(torch_kernel(**copy_batch(quantized)), reference_op(**copy_batch(quantized)),
                               atol=2e-5, rtol=2e-5)
