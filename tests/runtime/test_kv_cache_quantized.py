"""A quantized KV pool: int8 / fp8 caches with scale pools, allocated, sized and moved block by block together."""

from __future__ import annotations

import pytest
import torch

from octavo.runtime.kv_cache import KVCache, bytes_per_block

pytestmark = pytest.mark.usefixtures("one_thread")


def layout(cache_dtype: str) -> dict:
    return {"num_layers": 2, "num_kv_heads": 3, "head_dim": 8, "block_size": 4, "cache_dtype": cache_dtype,
            "cache_inputs": [[f"key_cache_{i}", f"value_cache_{i}"] for i in range(2)],
            "scale_dtype": "float32", "scale_inputs": [[f"key_scale_cache_{i}", f"value_scale_cache_{i}"]
                                                       for i in range(2)]}


@pytest.mark.parametrize(("cache_dtype", "itemsize"), [("int8", 1), ("float8_e4m3fn", 1)])
def test_pools_and_their_sizes(cache_dtype, itemsize):
    cache = KVCache(layout(cache_dtype), 5, torch.device("cpu"), 2)
    assert {name: (tuple(t.shape), t.dtype) for name, t in cache.tensors.items() if "scale" in name} == {
        f"{kind}_scale_cache_{i}": ((5, 4, 3), torch.float32) for kind in ("key", "value") for i in range(2)}
    assert all(t.shape == (5, 4, 3, 8) and t.dtype == getattr(torch, cache_dtype)
               for name, t in cache.tensors.items() if "scale" not in name)
    # Per layer: K and V, 4 slots x 3 heads x (8 values of 1 byte + one float32 scale).
    assert bytes_per_block(layout(cache_dtype)) == 2 * 2 * 4 * 3 * (8 * itemsize + 4)
    assert cache.num_bytes == 5 * bytes_per_block(layout(cache_dtype))
    assert set(cache.host_tensors) == set(cache.tensors)


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn"])
def test_copy_and_swap_move_scales_with_their_blocks(cache_dtype):
    cache = KVCache(layout(cache_dtype), 5, torch.device("cpu"), 3)
    generator = torch.Generator().manual_seed(0)
    for tensor in [*cache.tensors.values(), *cache.host_tensors.values()]:
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    before = {name: tensor.clone() for name, tensor in cache.tensors.items()}

    cache.copy_blocks([(1, 3)])
    cache.swap_out([(4, 0), (2, 2)])
    host_after_out = {name: tensor.clone() for name, tensor in cache.host_tensors.items()}
    cache.swap_in([(2, 0)])

    for name, tensor in cache.tensors.items():
        raw, original = tensor.view(torch.int8) if tensor.dtype.itemsize == 1 else tensor, before[name]
        original = original.view(torch.int8) if original.dtype.itemsize == 1 else original
        assert torch.equal(raw[3], original[1]), f"{name}: copy-on-write"
        assert torch.equal(raw[0], original[2]), f"{name}: swapped out from 2, back in at 0"
        host = host_after_out[name]
        host = host.view(torch.int8) if host.dtype.itemsize == 1 else host
        assert torch.equal(host[0], original[4]) and torch.equal(host[2], original[2])
        assert torch.equal(raw[4], original[4]) and torch.equal(raw[2], original[2])  # sources keep their blocks
