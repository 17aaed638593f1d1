"""Triton kernel: octavo.rotary_embedding (rotate_half / neox RoPE from a cos/sin cache).

Semantics: query [B, Hq, T, D], key [B, Hkv, T, D] (any strides), positions
int64 [T], cos_sin_cache [max_positions, 2, D] holding cos(p) and sin(p).
Returns new tensors ``x * cos + rotate_half(x) * sin`` with cos/sin taken at
``positions[t]`` and broadcast over heads, where
``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``. Computed in float32
and rounded once to the input dtype (the unfused graph rounds after each
op, so results are close to it, not bitwise equal).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from octavo.codegen.triton_backend.availability import rows_per_program


@triton.jit
def _rotary_kernel(
    input_ptr, output_ptr, positions_ptr, cos_sin_ptr,
    stride_b, stride_h, stride_t, stride_d,
    out_stride_b, out_stride_h, out_stride_t, out_stride_d,
    cache_stride_position, cache_stride_kind, num_heads, num_tokens, half,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,  # noqa: N803
):
    # Rows are (token, head) pairs of one batch entry: row r is token r // H, head r % H.
    batch = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    tokens = rows // num_heads
    heads = rows % num_heads
    dims = tl.arange(0, BLOCK_HALF)
    row_valid = tokens < num_tokens
    mask = row_valid[:, None] & (dims < half)[None, :]
    # cos and sin at each row's position (entries 0 and 1 of the cache row), both halves of the head dim.
    positions = tl.load(positions_ptr + tokens, mask=row_valid, other=0).to(tl.int64)
    cos_pointers = cos_sin_ptr + positions[:, None] * cache_stride_position + dims[None, :]
    cos_first = tl.load(cos_pointers, mask=mask, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_pointers + half, mask=mask, other=0.0).to(tl.float32)
    sin_first = tl.load(cos_pointers + cache_stride_kind, mask=mask, other=0.0).to(tl.float32)
    sin_second = tl.load(cos_pointers + cache_stride_kind + half, mask=mask, other=0.0).to(tl.float32)
    # The rows' first and second halves.
    source = (input_ptr + batch * stride_b + tokens[:, None].to(tl.int64) * stride_t + heads[:, None] * stride_h
              + dims[None, :] * stride_d)
    first = tl.load(source, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(source + half * stride_d, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, with rotate_half = (-second, first); rounded once on store.
    target = (output_ptr + batch * out_stride_b + tokens[:, None].to(tl.int64) * out_stride_t
              + heads[:, None] * out_stride_h + dims[None, :] * out_stride_d)
    tl.store(target, (first * cos_first - second * sin_first).to(output_ptr.dtype.element_ty), mask=mask)
    tl.store(target + half * out_stride_d, (second * cos_second + first * sin_second).to(output_ptr.dtype.element_ty),
             mask=mask)


def rotary_embedding(query: Tensor, key: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """octavo.rotary_embedding (see the module docstring): returns (rotated query, rotated key)."""
    head_dim = query.shape[-1]
    if head_dim % 2 or cos_sin_cache.shape[-1] != head_dim or key.shape[-1] != head_dim:
        raise ValueError(f"rotary_embedding needs one even head dim for query, key and cache, got {head_dim}, "
                         f"{key.shape[-1]} and {cos_sin_cache.shape[-1]}")
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    return _rotate(query, positions, cache), _rotate(key, positions, cache)


def _rotate(tensor: Tensor, positions: Tensor, cache: Tensor) -> Tensor:
    """One launch over [B, H, T, D]: a new tensor of the same shape and strides."""
    batch, num_heads, num_tokens, head_dim = tensor.shape
    output = torch.empty_like(tensor)
    if output.numel() == 0:
        return output
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_r = rows_per_program(block_half, num_tokens * num_heads)
    _rotary_kernel[(triton.cdiv(num_tokens * num_heads, block_r), batch)](
        tensor, output, positions, cache, *tensor.stride(), *output.stride(), cache.stride(0), cache.stride(1),
        num_heads, num_tokens, half, BLOCK_R=block_r, BLOCK_HALF=block_half,
    )
    return output
