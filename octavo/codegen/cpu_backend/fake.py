"""Fake (meta) implementations of the octavo_cpu ops, so torch.compile treats them as opaque kernels."""

from __future__ import annotations

import torch

_registered = False


def register_fake_kernels() -> None:
    """Register the output shapes of every octavo_cpu op with torch.library (once per process)."""
    global _registered
    if _registered:
        return

    @torch.library.register_fake("octavo_cpu::paged_attention")
    def _(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
          sliding_window=-1, key_scale_cache=None, value_scale_cache=None, soft_cap=0.0):
        return query.new_empty(query.shape[:-1] + value.shape[-1:])

    @torch.library.register_fake("octavo_cpu::linear_w16")
    def _(input, weight, bias=None):
        return input.new_empty(input.shape[:-1] + weight.shape[:1], dtype=torch.float32)

    @torch.library.register_fake("octavo_cpu::linear_w8")
    def _(x, qweight, scales, bias, group_size, bf16_gemm=False):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("octavo_cpu::linear_w4")
    def _(x, qweight, scales, offsets, bias, group_size, bf16_gemm=False):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("octavo_cpu::linear_fp8")
    def _(x, qweight, scales, bias, bf16_gemm=False):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("octavo_cpu::pack_w8a8")
    def _(qweight):
        blocks, steps = -(-qweight.shape[0] // 16), -(-qweight.shape[1] // 4)
        return qweight.new_empty((blocks, steps, 16, 4), dtype=torch.uint8)

    @torch.library.register_fake("octavo_cpu::linear_w8a8")
    def _(x, packed, scales, bias, out_features, in_features):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("octavo_cpu::moe")
    def _(x, router_weight, gate_up, down, top_k, normalize, activation="silu", round_weights=True,
          gate_up_scales=None, gate_up_offsets=None, down_scales=None, down_offsets=None, group_size=0):
        return torch.empty_like(x)

    @torch.library.register_fake("octavo_cpu::linear_bf16")
    def _(input, weight, bias=None):
        return input.new_empty(input.shape[:-1] + weight.shape[:1])

    _registered = True
