"""Time every Triton kernel against its torch-backend counterpart on CUDA, at SmolLM2-135M's sizes.

Run by scripts/gpu_check.sh: ``python tests/codegen/triton/kernel_timings.py``
(a CUDA device is required; TRITON_INTERPRET must be unset). Prints a table
of median times (triton.testing.do_bench) and the speedup over torch.
"""

from __future__ import annotations

import sys

import torch

# SmolLM2-135M: hidden 576, 9 query heads, 3 kv heads, head dim 64, intermediate 1536.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK_SIZE = 576, 9, 3, 64, 1536, 16
DTYPE = torch.bfloat16


def paged_inputs(query_lens: list[int], seq_lens: list[int], device: torch.device) -> tuple:
    num_blocks = sum(-(-length // BLOCK_SIZE) for length in seq_lens) + 1
    max_blocks = max(-(-length // BLOCK_SIZE) for length in seq_lens)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    start = 0
    for row, length in enumerate(seq_lens):
        count = -(-length // BLOCK_SIZE)
        block_tables[row, :count] = torch.arange(start, start + count, dtype=torch.int32)
        start += count
    slots = []
    for row, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        positions = torch.arange(seq_len - query_len, seq_len)
        slots.append(block_tables[row, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE)
    num_tokens = sum(query_lens)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return (torch.randn(num_tokens, HEADS, HEAD_DIM, dtype=DTYPE, device=device),
            torch.randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device),
            torch.randn(num_tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device),
            torch.randn(cache_shape, dtype=DTYPE, device=device), torch.randn(cache_shape, dtype=DTYPE, device=device),
            torch.cat(slots).to(device), block_tables.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), query_start_loc.to(device), HEAD_DIM ** -0.5)


def cases(device: torch.device) -> list[tuple[str, str, object, object, tuple]]:
    """(kernel, shape, triton launcher, torch kernel, arguments)."""
    from octavo.codegen import torch_backend
    from octavo.codegen.triton_backend import activation, fused_pointwise, kv_cache_write, norm, paged_attention, rotary
    from octavo.ir.ops.fused_pointwise import Reference, encode_program, evaluate_program

    tokens = 512
    x = torch.randn(1, tokens, HIDDEN, dtype=DTYPE, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, dtype=DTYPE, device=device)
    query = torch.randn(1, tokens, HEADS, HEAD_DIM, dtype=DTYPE, device=device).transpose(1, 2)
    key = torch.randn(1, tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device).transpose(1, 2)
    cos_sin = torch.randn(8192, 2, HEAD_DIM, dtype=DTYPE, device=device)
    positions = torch.arange(tokens, device=device)
    gate_up = torch.randn(1, tokens, 2 * INTERMEDIATE, dtype=DTYPE, device=device)
    write_args = paged_inputs([tokens], [tokens], device)
    decode = paged_inputs([1] * 64, [1024] * 64, device)
    prefill = paged_inputs([512] * 4, [512] * 4, device)
    program = encode_program([
        {"op": "aten._to_copy.default", "args": [Reference("input", 0)], "kwargs": {"dtype": torch.float32}},
        {"op": "aten.pow.Tensor_Scalar", "args": [Reference("step", 0), 2]},
        {"op": "aten.mean.dim", "args": [Reference("step", 1), [-1], True]},
        {"op": "aten.add.Tensor", "args": [Reference("step", 2), 1e-5]},
        {"op": "aten.rsqrt.default", "args": [Reference("step", 3)]},
        {"op": "aten.mul.Tensor", "args": [Reference("step", 0), Reference("step", 4)]},
        {"op": "aten._to_copy.default", "args": [Reference("step", 5)], "kwargs": {"dtype": DTYPE}},
        {"op": "aten.mul.Tensor", "args": [Reference("input", 1), Reference("step", 6)]},
    ])
    write_torch = torch_backend.attention.write_kv_cache
    return [
        ("rms_norm", f"[{tokens}, {HIDDEN}]", norm.rms_norm, torch_backend.rms_norm, (x, weight, 1e-5)),
        ("fused_add_rms_norm", f"[{tokens}, {HIDDEN}]", norm.fused_add_rms_norm, torch_backend.fused_add_rms_norm,
         (x, residual, weight, 1e-5)),
        ("rotary_embedding", f"q [{HEADS}, {tokens}, {HEAD_DIM}]", rotary.rotary_embedding,
         torch_backend.rotary_embedding, (query, key, positions, cos_sin)),
        ("silu_and_mul", f"[{tokens}, {2 * INTERMEDIATE}]", activation.silu_and_mul, torch_backend.silu_and_mul,
         (gate_up,)),
        ("kv_cache_write", f"{tokens} tokens", kv_cache_write.write_kv_cache, write_torch, write_args[1:6]),
        ("paged_attention decode", "64 seqs x 1024 ctx", paged_attention.paged_attention,
         torch_backend.paged_attention, decode),
        ("paged_attention prefill", "4 seqs x 512", paged_attention.paged_attention, torch_backend.paged_attention,
         prefill),
        ("fused_pointwise (rms)", f"[{tokens}, {HIDDEN}]", fused_pointwise.fused_pointwise, evaluate_program,
         ([x, weight], program)),
    ]


def main() -> int:
    import triton.testing

    if not torch.cuda.is_available():
        print("kernel_timings: no CUDA device")
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{'kernel':<26}{'shape':<22}{'triton us':>11}{'torch us':>11}{'speedup':>9}   ({DTYPE}, "
          f"{torch.cuda.get_device_name()})")
    for name, shape, triton_kernel, torch_kernel, arguments in cases(device):
        triton_ms = triton.testing.do_bench(lambda kernel=triton_kernel, args=arguments: kernel(*args))
        torch_ms = triton.testing.do_bench(lambda kernel=torch_kernel, args=arguments: kernel(*args))
        print(f"{name:<26}{shape:<22}{1000 * triton_ms:>11.1f}{1000 * torch_ms:>11.1f}{torch_ms / triton_ms:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
