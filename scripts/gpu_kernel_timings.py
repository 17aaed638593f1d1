"""GPU check step: every Triton kernel against its torch-backend counterpart, read against the device's ceilings.

Medians of triton.testing.do_bench, bf16, at SmolLM2-135M's sizes (hidden 576, 9/3 heads of 64,
intermediate 1536) and, for decode attention, the Llama-3.1-8B shape's heads (32/8 of 128) at 4096
tokens of context. Each kernel's figure is its time; its ratio is the share of the copy bandwidth
(measured in this process) that the bytes it must move reach, and for prefill attention its time over
torch's SDPA (flash) on the same tokens, unpaged. Dry run: tiny shapes in the interpreter, timed by the
wall clock (the figures mean nothing there; the code runs).
"""

from __future__ import annotations

import torch
from gpu_records import CUDA, DEVICE, ceilings, checking, figure, main_guard

from octavo.bench.roofline import median_seconds

DTYPE, BLOCK_SIZE = torch.bfloat16, 16
SMOL = dict(heads=9, kv_heads=3, head_dim=64)
BIG = dict(heads=32, kv_heads=8, head_dim=128)
TOKENS = 512 if CUDA else 16
HIDDEN, INTERMEDIATE = 576, 1536
DECODE = [("64 seqs x 1024 ctx (SmolLM2 heads)", 64, 1024, SMOL), ("64 seqs x 4096 ctx (8B heads)", 64, 4096, BIG)] \
    if CUDA else [("4 seqs x 64 ctx", 4, 64, SMOL)]
PREFILL = (4, 512) if CUDA else (2, 32)


def timed(run) -> float:
    if CUDA:
        import triton.testing

        return triton.testing.do_bench(run, return_mode="median") / 1000
    return median_seconds(run, DEVICE, repeats=3, warmup=1)


def paged_inputs(query_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, head_dim: int) -> tuple:
    """paged_attention's arguments: sequences in consecutive blocks, the new tokens at their slots."""
    block_counts = [-(-length // BLOCK_SIZE) for length in seq_lens]
    tables = torch.zeros(len(seq_lens), max(block_counts), dtype=torch.int32)
    first = 0
    for row, count in enumerate(block_counts):
        tables[row, :count] = torch.arange(first, first + count, dtype=torch.int32)
        first += count
    slots = []
    for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        positions = torch.arange(seq_len - query_len, seq_len)
        slots.append(tables[row, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(query_lens).cumsum(0)
    tokens, cache_shape = sum(query_lens), (first + 1, BLOCK_SIZE, kv_heads, head_dim)

    def random(*shape):
        return torch.randn(*shape, dtype=DTYPE, device=DEVICE)

    return (random(tokens, heads, head_dim), random(tokens, kv_heads, head_dim), random(tokens, kv_heads, head_dim),
            random(*cache_shape), random(*cache_shape), torch.cat(slots).to(DEVICE), tables.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), starts.to(DEVICE), head_dim ** -0.5)


def pointwise_cases() -> list[tuple]:
    """(kernel, shape, triton launcher, torch kernel, arguments, bytes moved)."""
    from octavo.codegen import torch_backend
    from octavo.codegen.triton_backend import activation, kv_cache_write, norm, rotary

    x = torch.randn(1, TOKENS, HIDDEN, dtype=DTYPE, device=DEVICE)
    residual, weight = torch.randn_like(x), torch.randn(HIDDEN, dtype=DTYPE, device=DEVICE)
    query = torch.randn(1, TOKENS, SMOL["heads"], 64, dtype=DTYPE, device=DEVICE).transpose(1, 2)
    key = torch.randn(1, TOKENS, SMOL["kv_heads"], 64, dtype=DTYPE, device=DEVICE).transpose(1, 2)
    cos_sin = torch.randn(8192, 2, 64, dtype=DTYPE, device=DEVICE)
    gate_up = torch.randn(1, TOKENS, 2 * INTERMEDIATE, dtype=DTYPE, device=DEVICE)
    write = paged_inputs([TOKENS], [TOKENS], **SMOL)[1:6]
    size = x.numel() * 2
    return [
        ("rms_norm", f"[{TOKENS}, {HIDDEN}]", norm.rms_norm, torch_backend.rms_norm, (x, weight, 1e-5), 2 * size),
        ("fused_add_rms_norm", f"[{TOKENS}, {HIDDEN}]", norm.fused_add_rms_norm, torch_backend.fused_add_rms_norm,
         (x, residual, weight, 1e-5), 4 * size),
        ("rotary_embedding", f"q [{SMOL['heads']}, {TOKENS}, 64]", rotary.rotary_embedding,
         torch_backend.rotary_embedding, (query, key, torch.arange(TOKENS, device=DEVICE), cos_sin),
         2 * 2 * (query.numel() + key.numel())),
        ("silu_and_mul", f"[{TOKENS}, {2 * INTERMEDIATE}]", activation.silu_and_mul, torch_backend.silu_and_mul,
         (gate_up,), 2 * gate_up.numel() * 3 // 2),
        ("kv_cache_write", f"{TOKENS} tokens", kv_cache_write.write_kv_cache, torch_backend.attention.write_kv_cache,
         write, 2 * 2 * 2 * write[0].numel()),
    ]


def time_pointwise(bandwidth: float) -> None:
    for name, shape, triton_kernel, torch_kernel, arguments, num_bytes in pointwise_cases():
        with checking(f"kernel {name}"):
            ours = timed(lambda kernel=triton_kernel, args=arguments: kernel(*args))
            theirs = timed(lambda kernel=torch_kernel, args=arguments: kernel(*args))
            figure(f"kernel {name} {shape}", ours * 1e6, "us", ratio=num_bytes / ours / bandwidth,
                   ratio_of="bytes moved / time / copy bandwidth", detail=f"torch backend {theirs * 1e6:.1f} us "
                   f"({theirs / ours:.2f}x); {num_bytes / 1e6:.2f} MB")


def time_attention(bandwidth: float) -> None:
    from octavo.codegen.triton_backend.paged_attention import paged_attention

    for label, seqs, context, heads in DECODE:
        with checking(f"kernel paged_attention decode {label}"):
            arguments = paged_inputs([1] * seqs, [context] * seqs, **heads)
            kv_bytes = seqs * context * heads["kv_heads"] * heads["head_dim"] * 2 * 2
            ours = timed(lambda args=arguments: paged_attention(*args))
            figure(f"kernel paged_attention decode {label}", ours * 1e6, "us", ratio=kv_bytes / ours / bandwidth,
                   ratio_of="K/V bytes read / time / copy bandwidth", target=">= 0.6",
                   detail=f"{kv_bytes / 1e6:.0f} MB of K/V")
    seqs, length = PREFILL
    with checking("kernel paged_attention prefill"):
        arguments = paged_inputs([length] * seqs, [length] * seqs, **SMOL)
        ours = timed(lambda: paged_attention(*arguments))
        query, key, value = arguments[0], arguments[1], arguments[2]
        group = SMOL["heads"] // SMOL["kv_heads"]

        def batched(tensor):  # [seqs * length, H, D] -> [seqs, Hq, length, D], GQA heads repeated
            return tensor.view(seqs, length, -1, tensor.shape[-1]).transpose(1, 2).repeat_interleave(
                group if tensor.shape[1] != SMOL["heads"] else 1, dim=1).contiguous()

        q, k, v = batched(query), batched(key), batched(value)
        sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        figure(f"kernel paged_attention prefill {seqs} seqs x {length}", ours * 1e6, "us", ratio=ours / sdpa,
               ratio_of="time / torch SDPA on the same tokens, unpaged (causal)", target="<= 1.5",
               detail=f"SDPA {sdpa * 1e6:.1f} us")


def main() -> None:
    torch.manual_seed(0)
    bandwidth, flops = ceilings()
    figure("copy bandwidth (kernel timings process)", bandwidth / 1e12, "TB/s")
    figure("bf16 matmul rate (kernel timings process)", flops / 1e12, "TFLOP/s")
    time_attention(bandwidth)
    time_pointwise(bandwidth)


if __name__ == "__main__":
    main_guard(main)
