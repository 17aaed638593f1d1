"""Triton kernels: octavo.lora, punica-style batched LoRA (every token reads its own adapter's factors).

Two launches: `shrink` computes ``v[t] = lora_a[slot[t]] @ x[t]`` (R values per token, float32), one
program per token; `expand` adds ``lora_b[slot[t]] @ v[t]`` to a block of ``y[t]``'s columns, one program
per (token, column block). A token of slot -1 copies ``y[t]``. Semantics: octavo.ir.ops.lora.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, v_ptr, K, R, x_stride, a_slot_stride,  # noqa: N803
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # noqa: N803
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    ranks = tl.arange(0, BLOCK_R)
    # v = A[slot] @ x[token], accumulated over K in float32 (nothing to do for slot -1).
    accumulator = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        for start in range(0, K, BLOCK_K):
            columns = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token * x_stride + columns, mask=columns < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * a_slot_stride + ranks[:, None] * K + columns[None, :],
                        mask=(ranks < R)[:, None] & (columns < K)[None, :], other=0.0).to(tl.float32)
            accumulator += tl.sum(a * x[None, :], axis=1)
    tl.store(v_ptr + token * BLOCK_R + ranks, accumulator)


@triton.jit
def _expand_kernel(y_ptr, b_ptr, slots_ptr, v_ptr, out_ptr, N, R, y_stride, b_slot_stride,  # noqa: N803
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):  # noqa: N803
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + token)
    y = tl.load(y_ptr + token * y_stride + columns, mask=columns < N, other=0.0).to(tl.float32)
    # out = y + B[slot] @ v[token], rounded once to the output dtype.
    if slot >= 0:
        ranks = tl.arange(0, BLOCK_R)
        v = tl.load(v_ptr + token * BLOCK_R + ranks)
        b = tl.load(b_ptr + slot * b_slot_stride + columns[:, None] * R + ranks[None, :],
                    mask=(columns < N)[:, None] & (ranks < R)[None, :], other=0.0).to(tl.float32)
        y += tl.sum(b * v[None, :], axis=1)
    tl.store(out_ptr + token * N + columns, y.to(out_ptr.dtype.element_ty), mask=columns < N)


def lora(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, token_slots: Tensor) -> Tensor:
    """octavo.lora (see octavo.ir.ops.lora)."""
    rows_x = x.reshape(-1, x.shape[-1])
    rows_y = y.reshape(-1, y.shape[-1])
    rows_x = rows_x if rows_x.stride(-1) == 1 else rows_x.contiguous()
    rows_y = rows_y if rows_y.stride(-1) == 1 else rows_y.contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    tokens, k = rows_x.shape
    n, r = rows_y.shape[1], lora_a.shape[1]
    out = torch.empty(tokens, n, dtype=y.dtype, device=y.device)
    if tokens == 0:
        return out.view(y.shape)
    block_r = max(triton.next_power_of_2(r), 16)
    shrunk = torch.empty(tokens, block_r, dtype=torch.float32, device=y.device)
    block_k = min(triton.next_power_of_2(k), 128)
    _shrink_kernel[(tokens,)](rows_x, lora_a, token_slots, shrunk, k, r, rows_x.stride(0), lora_a.stride(0),
                              BLOCK_R=block_r, BLOCK_K=block_k)
    block_n = min(triton.next_power_of_2(n), 128)
    _expand_kernel[(tokens, triton.cdiv(n, block_n))](rows_y, lora_b, token_slots, shrunk, out, n, r,
                                                      rows_y.stride(0), lora_b.stride(0), BLOCK_R=block_r,
                                                      BLOCK_N=block_n)
    return out.view(y.shape)
