"""Triton kernels: octavo.moe as two grouped GEMMs over token-expert pairs sorted by expert, block-aligned.

Semantics: octavo.ir.ops.moe.moe. The launcher:

1. routes on the device with torch ops (the router linear, the float32 softmax, a stable descending
   sort for the top_k experts, the optional renormalization and rounding): experts [T, k];
2. aligns: the P = T * k (token, slot) pairs, numbered ``t * k + j``, sorted by expert (stable: token
   order within an expert), each expert's run padded to a multiple of BLOCK_M with the sentinel P,
   in a buffer of the fixed size ``P + E * (BLOCK_M - 1)`` rounded up to BLOCK_M; ``block_experts[b]``
   is the expert of block b (E for blocks past the last run). Everything is computed on the device
   from shapes alone, so a step's launches never wait for the host (CUDA-graph friendly);
3. the grouped GEMM kernel, once for the gate/up projection (rows: each pair's token of x) and once
   for the down projection (rows: each pair's activated row), each program one [BLOCK_M, BLOCK_N]
   tile of one block: all its rows belong to one expert, whose weight tiles it loads (dequantizing
   w8 / w4 tiles as quantized_linear.py does) and multiplies in float32. The down projection scales
   each row by its routing weight in the epilogue;
4. the gated activation with activation.py's kernel, and the sum over each token's slots in slot
   order in float32 (torch ops).

Blocks of the sentinel expert and padding rows do nothing, so an expert no token chose is never
read. Results equal the definition up to float32 summation order (and TF32 rounding of the weights
for 16-bit activations, see attention_decode.dot_precision).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.profiler import record_function

from octavo.codegen.triton_backend.activation import gelu_and_mul, silu_and_mul
from octavo.codegen.triton_backend.attention_decode import dot_precision
from octavo.codegen.triton_backend.availability import interpreting

FLOAT, W8, W4 = 0, 1, 2


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, weight_ptr, scales_ptr, offsets_ptr, routing_ptr, output_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_pairs, num_experts, out_features, in_features, group_size, num_groups, top_k,
    a_row_stride, weight_expert_stride, weight_row_stride, scales_expert_stride, output_row_stride,
    A_ROWS_ARE_TOKENS: tl.constexpr, LAYOUT: tl.constexpr, MUL_ROUTING: tl.constexpr,  # noqa: N803
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # noqa: N803
    BLOCK_K: tl.constexpr,  # noqa: N803
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    # Blocks past the last expert's run hold only padding.
    if expert >= num_experts:
        return
    # This block's pairs (sentinel num_pairs for padding rows) and the rows of A they read.
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_valid = pairs < num_pairs
    if A_ROWS_ARE_TOKENS:
        a_rows = (pairs // top_k).to(tl.int64)
    else:
        a_rows = pairs.to(tl.int64)
    columns = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    column_mask = columns < out_features
    weight_base = weight_ptr + expert * weight_expert_stride
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < in_features
        # Gathered rows of A [BLOCK_M, BLOCK_K]; padding rows and columns past K load 0.
        a = tl.load(a_ptr + a_rows[:, None] * a_row_stride + ks[None, :], mask=row_valid[:, None] & k_mask[None, :],
                    other=0.0)
        # The expert's weight slice transposed [BLOCK_K, BLOCK_N], dequantized to float32.
        tile_mask = k_mask[:, None] & column_mask[None, :]
        if LAYOUT == 0:
            weight = tl.load(weight_base + columns[None, :] * weight_row_stride + ks[:, None], mask=tile_mask,
                             other=0.0).to(tl.float32)
        else:
            group_index = expert * scales_expert_stride + columns[None, :] * num_groups + (ks // group_size)[:, None]
            scale = tl.load(scales_ptr + group_index, mask=tile_mask, other=0.0).to(tl.float32)
            if LAYOUT == 1:
                q = tl.load(weight_base + columns[None, :] * weight_row_stride + ks[:, None], mask=tile_mask, other=0)
                weight = q.to(tl.float32) * scale
            else:
                packed = tl.load(weight_base + columns[None, :] * weight_row_stride + (ks // 2)[:, None],
                                 mask=tile_mask, other=0)
                nibble = (packed >> ((ks % 2) * 4).to(tl.uint8)[:, None]) & 0x0F
                offset = tl.load(offsets_ptr + group_index, mask=tile_mask, other=0.0).to(tl.float32)
                weight = nibble.to(tl.float32) * scale + offset
        accumulator = tl.dot(a.to(tl.float32), weight, accumulator, input_precision=DOT_PRECISION)
    # Each row rounded to x's dtype (A's), then (down projection) times its routing weight and rounded to the
    # product's dtype: the definition's order (the expert's output in x's dtype, then the weighted product).
    result = accumulator.to(a_ptr.dtype.element_ty)
    if MUL_ROUTING:
        weights = tl.load(routing_ptr + pairs, mask=row_valid, other=0.0)
        result = result.to(tl.float32) * weights.to(tl.float32)[:, None]
    result = result.to(output_ptr.dtype.element_ty)
    tl.store(output_ptr + pairs.to(tl.int64)[:, None] * output_row_stride + columns[None, :], result,
             mask=row_valid[:, None] & column_mask[None, :])


def moe(x: Tensor, router_weight: Tensor, gate_up: Tensor, down: Tensor, top_k: int, normalize: bool,
        activation: str = "silu", round_weights: bool = True, gate_up_scales: Tensor | None = None,
        gate_up_offsets: Tensor | None = None, down_scales: Tensor | None = None, down_offsets: Tensor | None = None,
        group_size: int = 0) -> Tensor:
    """octavo.moe (see the module docstring)."""
    from octavo.ir.ops.moe import route

    num_tokens = x.shape[0]
    num_experts = router_weight.shape[0]
    with record_function("octavo_triton::moe_routing"):
        weights, experts = route(x, router_weight, top_k, normalize, x.dtype if round_weights else torch.float32)
    if num_tokens == 0:
        return torch.empty_like(x)
    block_m = 16
    with record_function("octavo_triton::moe_permutation"):
        sorted_pairs, block_experts = align_pairs(experts.flatten(), num_experts, block_m)
    rows = x if x.stride(-1) == 1 else x.contiguous()
    # The weighted product is rounded to x's dtype with rounded weights (x.dtype * x.dtype), kept float32 without.
    product_dtype = x.dtype if round_weights else torch.float32
    with record_function("octavo_triton::moe_experts"):
        projected = _grouped_gemm(rows, gate_up, gate_up_scales, gate_up_offsets, group_size, sorted_pairs,
                                  block_experts, top_k, num_experts, block_m, tokens=True, routing=None,
                                  out_dtype=x.dtype)
        hidden = _gated_activation(projected, activation)
        out = _grouped_gemm(hidden, down, down_scales, down_offsets, group_size, sorted_pairs, block_experts,
                            top_k, num_experts, block_m, tokens=False, routing=weights.flatten(),
                            out_dtype=product_dtype)
    with record_function("octavo_triton::moe_permutation"):
        per_slot = out.view(num_tokens, top_k, -1).float()
        total = per_slot[:, 0].clone()
        for slot in range(1, top_k):
            total += per_slot[:, slot]
        return total.to(x.dtype)


def _gated_activation(projected: Tensor, activation: str) -> Tensor:
    if activation == "silu":
        return silu_and_mul(projected)
    return gelu_and_mul(projected, "tanh" if activation == "gelu_tanh" else "none")


def align_pairs(flat_experts: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """(sorted pair ids with padding, the expert of each block): step 2 of the module docstring."""
    num_pairs = flat_experts.numel()
    device = flat_experts.device
    counts = torch.bincount(flat_experts, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.sort(flat_experts, stable=True).indices
    sorted_experts = flat_experts[order]
    run_starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - run_starts[sorted_experts]
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[(padded_ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_experts


def _grouped_gemm(a: Tensor, weight: Tensor, scales: Tensor | None, offsets: Tensor | None, group_size: int,
                  sorted_pairs: Tensor, block_experts: Tensor, top_k: int, num_experts: int, block_m: int, *,
                  tokens: bool, routing: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    num_pairs = (a.shape[0] * top_k) if tokens else a.shape[0]
    in_features = a.shape[1]
    out_features = weight.shape[1]
    layout = FLOAT if scales is None else (W8 if offsets is None else W4)
    group_size = group_size or in_features  # 0: one scale per output channel
    output = torch.empty((num_pairs, out_features), dtype=out_dtype, device=a.device)
    weight = weight.contiguous()
    scales = None if scales is None else scales.contiguous()
    block_n, block_k = (32, 32) if interpreting() else (64, 32)
    grid = (block_experts.shape[0], triton.cdiv(out_features, block_n))
    _grouped_gemm_kernel[grid](
        a, weight, weight if scales is None else scales, weight if offsets is None else offsets.contiguous(),
        a if routing is None else routing, output, sorted_pairs, block_experts,
        num_pairs, num_experts, out_features, in_features, max(group_size, 1),
        1 if scales is None else scales.shape[-1], top_k,
        a.stride(0), weight.stride(0), weight.stride(1), 0 if scales is None else scales.stride(0), output.stride(0),
        A_ROWS_ARE_TOKENS=tokens, LAYOUT=layout, MUL_ROUTING=routing is not None,
        DOT_PRECISION=dot_precision(a), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return output

