"""The C++ paged attention (octavo_cpu::paged_attention) against the op's definition (octavo::paged_attention).

Every batch comes from paged_batches.make_batch: contexts in shuffled blocks, NaN in every slot
no sequence wrote, so a kernel that reads past a context or through a wrong table entry fails.
Outputs must match the reference op within the dtype's tolerance (paged_batches.TOLERANCE) and
the cache writes (values and scales) must equal the reference's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from octavo.ir.ops.attention import paged_attention as reference_op
from tests.codegen.paged_batches import TOLERANCE, copy_batch, make_batch, unshare_blocks

CACHES = ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache")

# (context length, query length): decodes, a whole prompt, prefill chunks over cached context, one-token contexts.
MIXED = [(9, 1), (20, 5), (31, 1), (9, 9), (1, 1), (70, 1), (40, 17)]

EDGE_CASES = {
    # name: (shapes, block_size, num_heads, num_kv_heads, head_dim, dtype, sliding_window)
    "one-token-prompt": ([(1, 1)], 16, 4, 4, 64, torch.float32, -1),
    "prefill-ends-on-and-past-block": ([(16, 16), (17, 17)], 16, 6, 2, 64, torch.float32, -1),
    "decode-ends-on-and-past-block": ([(16, 1), (17, 1), (33, 1)], 16, 8, 1, 128, torch.bfloat16, -1),
    "chunk-ends-on-and-past-block": ([(16, 8), (25, 9)], 8, 3, 3, 64, torch.float32, -1),
    "decode-ends-on-and-past-chunk": ([(64, 1), (65, 1), (128, 1), (129, 1)], 16, 6, 2, 64, torch.float32, -1),
    "prefill-longer-than-tile": ([(45, 40), (50, 1)], 16, 2, 1, 64, torch.float32, -1),
    "long-decodes-and-chunk": ([(300, 1), (200, 1), (150, 70)], 16, 9, 3, 64, torch.float32, -1),
    "sliding-window": ([(30, 1), (40, 12), (5, 1)], 8, 4, 2, 64, torch.float32, 8),
    "sliding-window-bf16": ([(20, 20), (24, 1)], 4, 6, 2, 64, torch.bfloat16, 6),
    "sliding-window-long": ([(300, 1), (200, 1), (150, 70)], 16, 6, 2, 64, torch.float32, 100),
    "head-dim-not-a-vector-multiple": ([(33, 1), (20, 20)], 16, 4, 2, 80, torch.float16, -1),
    "head-dim-8-fp32": ([(5, 1), (3, 3)], 4, 4, 2, 8, torch.float32, -1),
    "block-larger-than-chunk": ([(300, 1), (130, 1), (90, 30)], 128, 4, 2, 64, torch.float32, -1),
    "head-dim-96-decodes-bf16": ([(100, 1), (47, 1), (16, 1)], 16, 6, 2, 96, torch.bfloat16, -1),
    "head-dim-32-decodes-fp16-gqa5": ([(81, 1), (33, 1), (20, 4)], 16, 10, 2, 32, torch.float16, -1),
    "long-decodes-bf16": ([(300, 1), (200, 1), (129, 1), (64, 1)], 16, 9, 3, 64, torch.bfloat16, -1),
    "long-decodes-bf16-d128-gqa8": ([(260, 1), (65, 1), (16, 1)], 16, 8, 1, 128, torch.bfloat16, -1),
    "head-dim-32-decodes-bf16": ([(70, 1), (17, 1), (5, 1)], 16, 4, 2, 32, torch.bfloat16, -1),
}


def run_both(batch: dict) -> tuple[torch.Tensor, dict, torch.Tensor, dict]:
    """(kernel output, kernel's arguments after the call, reference output, reference's arguments after)."""
    kernel_batch, reference_batch = copy_batch(batch), copy_batch(batch)
    output = torch.ops.octavo_cpu.paged_attention(**kernel_batch)
    expected = reference_op(**reference_batch)
    return output, kernel_batch, expected, reference_batch


def assert_matches_reference(batch: dict) -> torch.Tensor:
    output, kernel_batch, expected, reference_batch = run_both(batch)
    rows = int(batch["query_start_loc"][-1])  # padding tokens' rows have no defined value
    dtype = batch["query"].dtype
    assert output.shape == expected.shape and output.dtype == dtype
    assert output.is_contiguous(), "graphs view the result as [tokens, heads * head_dim]"
    assert not output[:rows].isnan().any()
    torch.testing.assert_close(output[:rows], expected[:rows], **TOLERANCE[dtype])
    for name in CACHES:
        if name in batch:
            assert torch.equal(kernel_batch[name].view(torch.uint8), reference_batch[name].view(torch.uint8)), name
    return output[:rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8], ids=["gqa1", "gqa3", "gqa8"])
def test_mixed_batch_matches_reference(group, head_dim, dtype, cpu_kernels):
    num_kv_heads = 2 if group < 8 else 1
    batch = make_batch(MIXED, group * num_kv_heads, num_kv_heads, head_dim, block_size=8, dtype=dtype,
                       seed=group * head_dim, num_padding=2)
    assert_matches_reference(batch)


@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
def test_edge_cases_match_reference(case, cpu_kernels):
    shapes, block_size, num_heads, num_kv_heads, head_dim, dtype, window = EDGE_CASES[case]
    batch = make_batch(shapes, num_heads, num_kv_heads, head_dim, block_size=block_size, dtype=dtype,
                       sliding_window=window)
    assert_matches_reference(batch)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                         torch.float8_e4m3fn], ids=["fp32", "bf16", "fp16", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["q-fp32", "q-bf16"])
def test_every_cache_dtype(cache_dtype, dtype, cpu_kernels):
    batch = make_batch(MIXED, 6, 2, 64, dtype=dtype, cache_dtype=cache_dtype, num_padding=1, sliding_window=24)
    assert_matches_reference(batch)


def test_zero_rows_quantize_with_scale_one(cpu_kernels):
    batch = make_batch([(5, 2), (3, 1)], 4, 2, 64, cache_dtype=torch.int8)
    batch["key"][0] = 0.0
    _, after, _, reference = run_both(batch)
    slot = int(batch["slot_mapping"][0])
    block, offset = divmod(slot, batch["key_cache"].shape[1])
    assert torch.equal(after["key_scale_cache"][block, offset], torch.ones(2))
    assert not after["key_cache"][block, offset].any()
    assert torch.equal(after["key_cache"], reference["key_cache"])


def test_padding_tokens_are_neither_cached_nor_attended(cpu_kernels):
    batch = make_batch([(3, 3), (10, 1)], 4, 2, 64, block_size=4, num_padding=2)
    before = batch["key_cache"].clone()
    output, after, expected, _ = run_both(batch)
    torch.testing.assert_close(output[:4], expected[:4], **TOLERANCE[torch.float32])
    changed = (after["key_cache"].nan_to_num(7.0) != before.nan_to_num(7.0)).any(dim=(2, 3)).sum()
    assert int(changed) == 4  # the 4 real tokens' slots, none for the padding tokens


def test_reads_keys_through_the_block_table(cpu_kernels):
    """The same contexts in other physical blocks give the same bits: only the table moved."""
    batch = make_batch(MIXED, 6, 2, 64, seed=3)
    first = torch.ops.octavo_cpu.paged_attention(**copy_batch(batch))
    moved = copy_batch(batch)
    permutation = torch.randperm(batch["key_cache"].shape[0], generator=torch.Generator().manual_seed(5))
    inverse = torch.argsort(permutation)
    moved["key_cache"], moved["value_cache"] = batch["key_cache"][permutation], batch["value_cache"][permutation]
    moved["block_tables"] = inverse[batch["block_tables"].long()].to(torch.int32)
    block_size = batch["key_cache"].shape[1]
    slots = batch["slot_mapping"]
    moved["slot_mapping"] = inverse[slots // block_size] * block_size + slots % block_size
    assert torch.equal(torch.ops.octavo_cpu.paged_attention(**moved), first)


def schedule(batch: dict) -> dict:
    counts = torch.ops.octavo_cpu.paged_attention_schedule(
        batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], batch["key_cache"].shape[1],
        batch["key_cache"].shape[2], batch["query"].shape[1] // batch["key_cache"].shape[2],
        batch["sliding_window"])
    return dict(zip(("prefill", "shared", "single", "decodes", "whole_items"), counts, strict=True))


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, None), (torch.bfloat16, None),
                                                   (torch.float16, None), (torch.float32, torch.int8)],
                         ids=["fp32", "bf16", "fp16", "int8-cache"])
def test_cascade_equals_unshared_bit_for_bit(dtype, cache_dtype, cpu_kernels):
    """Decodes sharing a 160-token prefix read its full chunks once (cascade), with the same bits as unshared."""
    shapes = [(161, 1), (200, 1), (333, 1), (170, 1), (250, 1)]
    shared = make_batch(shapes, 9, 3, 64, dtype=dtype, cache_dtype=cache_dtype, shared_blocks=10, seed=11)
    unshared = unshare_blocks(shared)
    assert schedule(shared)["shared"] == 2 * 3  # chunks [0, 64) and [64, 128) of 3 kv heads
    assert schedule(unshared)["shared"] == 0
    cascade = assert_matches_reference(shared)
    assert torch.equal(torch.ops.octavo_cpu.paged_attention(**unshared), cascade)


def test_a_call_with_other_block_tables_is_planned_anew(cpu_kernels):
    """Every layer of a step reuses the previous call's schedule when lengths and tables are equal; here only the
    tables differ: one sequence leaves the shared prefix for blocks of other contents, so its chunks must no
    longer come from the cascade's shared partials."""
    shapes = [(161, 1), (200, 1), (333, 1)]
    shared = make_batch(shapes, 9, 3, 64, shared_blocks=10, seed=11)
    assert_matches_reference(shared)
    diverged = copy_batch(shared)
    generator = torch.Generator().manual_seed(12)
    fresh = {name: torch.randn((10, *shared[name].shape[1:]), generator=generator)
             for name in ("key_cache", "value_cache")}
    first_fresh = shared["key_cache"].shape[0]
    for name, blocks in fresh.items():
        diverged[name] = torch.cat([shared[name], blocks])
    diverged["block_tables"][1, :10] = torch.arange(first_fresh, first_fresh + 10, dtype=torch.int32)
    assert schedule(diverged)["shared"] == 2 * 3  # sequences 0 and 2 still share chunks [0, 64) and [64, 128)
    assert_matches_reference(diverged)
    assert_matches_reference(shared)


def test_a_decode_gives_the_same_bits_alone_and_in_any_batch(cpu_kernels):
    batch = make_batch(MIXED, 6, 2, 64, seed=4)
    together = torch.ops.octavo_cpu.paged_attention(**copy_batch(batch))
    starts = batch["query_start_loc"]
    for row in (0, 2, 5):  # decodes of 9, 31 and 70 tokens
        alone = copy_batch(batch)
        token = int(starts[row])
        for name in ("query", "key", "value"):
            alone[name] = batch[name][token:token + 1]
        alone.update(slot_mapping=batch["slot_mapping"][token:token + 1],
                     block_tables=batch["block_tables"][row:row + 1], seq_lens=batch["seq_lens"][row:row + 1],
                     query_start_loc=torch.tensor([0, 1], dtype=torch.int32))
        assert torch.equal(torch.ops.octavo_cpu.paged_attention(**alone)[0], together[token])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_items_of_every_head_or_of_one_give_the_same_bits(dtype, cpu_kernels):
    """A batch with enough decode chunks for its threads runs one item per chunk for all kv heads (reading a
    token's rows of every head as one run); with more threads than that keeps busy, one item per (chunk, kv
    head). The split only moves work between threads: the bits are the same, and both match the reference."""
    shapes = [(70 + 23 * index, 1) for index in range(10)] + [(80, 9)]
    batch = make_batch(shapes, 9, 3, 64, dtype=dtype, shared_blocks=4, seed=13)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = schedule(batch)
        by_item = {"whole": assert_matches_reference(batch)}
        torch.set_num_threads(64)
        per_head = schedule(batch)
        by_item["per head"] = assert_matches_reference(batch)
    finally:
        torch.set_num_threads(threads)
    decode_items = whole["shared"] + whole["single"]
    assert whole["whole_items"] * 3 == decode_items and whole["shared"] == 3  # chunk [0, 64) is shared
    assert per_head["whole_items"] == 0 and per_head["shared"] + per_head["single"] == decode_items
    assert torch.equal(by_item["whole"], by_item["per head"])


def test_bf16_cache_query_paths_depend_only_on_the_query(cpu_kernels):
    """With a bf16 cache, a float query whose values are all bf16 numbers may be scored on the stored pairs
    (dpbf16 where the CPU has it) and any other query by widening: each query's bits depend only on itself,
    never on which path the other heads of its kv group take, and both match the reference (products of two
    bf16 are exact in float: the paths differ only in the order of float additions, far inside 1e-5)."""
    shapes = [(200, 1), (129, 1), (64, 1), (17, 1)]
    batch = make_batch(shapes, 8, 2, 64, cache_dtype=torch.bfloat16, seed=8)
    rounded = batch["query"].to(torch.bfloat16).float()
    mixed, exact = copy_batch(batch), copy_batch(batch)
    mixed["query"][:, ::2] = rounded[:, ::2]  # every other head of each group is bf16-exact
    exact["query"] = rounded
    outputs = {name: assert_matches_reference(b) for name, b in (("mixed", mixed), ("exact", exact),
                                                                   ("float", batch))}
    assert torch.equal(outputs["mixed"][:, ::2], outputs["exact"][:, ::2])
    assert torch.equal(outputs["mixed"][:, 1::2], outputs["float"][:, 1::2])


def test_bad_arguments_name_what_is_wrong(cpu_kernels):
    batch = make_batch([(20, 1)], 4, 2, 64)
    batch["block_tables"][0, 1] = batch["key_cache"].shape[0]
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 1\].*outside the cache"):
        torch.ops.octavo_cpu.paged_attention(**batch)
    quantized = make_batch([(20, 1)], 4, 2, 64, cache_dtype=torch.int8)
    del quantized["value_scale_cache"]
    with pytest.raises(RuntimeError, match="needs its scale cache"):
        torch.ops.octavo_cpu.paged_attention(**quantized)
    short = make_batch([(20, 1)], 4, 2, 64)
    short["seq_lens"][0] = 60
    with pytest.raises(RuntimeError, match="needs 4 blocks but block_tables has 3 columns"):
        torch.ops.octavo_cpu.paged_attention(**short)


# Scores of unit-normal rows at scale 1/sqrt(D) spread over about +-3: a cap of 1.5 bends most of them.
SOFT_CAP = 1.5


@pytest.mark.parametrize(("dtype", "head_dim", "window"),
                         [(torch.float32, 64, -1), (torch.bfloat16, 64, -1), (torch.float32, 64, 24),
                          (torch.bfloat16, 128, 6), (torch.float16, 80, -1)],
                         ids=["fp32", "bf16", "fp32-window", "bf16-d128-window", "fp16-d80-tiled"])
def test_soft_capped_scores_match_reference(dtype, head_dim, window, cpu_kernels, monkeypatch):
    """Decodes (in place and tiled rows), prefills and chunks with capped scores; ATen's flash attention has no
    cap, so even where it is asked for every prefill the capped ones stay on the paged kernels."""
    monkeypatch.setenv("OCTAVO_CPU_PREFILL_ATTENTION", "aten")
    batch = make_batch(MIXED, 6, 2, head_dim, dtype=dtype, sliding_window=window, num_padding=1, seed=head_dim)
    batch["soft_cap"] = SOFT_CAP
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        capped = assert_matches_reference(batch)
    assert not any("flash_attention" in event.key for event in profile.key_averages())
    uncapped = {**batch, "soft_cap": 0.0}
    assert not torch.allclose(torch.ops.octavo_cpu.paged_attention(**copy_batch(uncapped))[:len(capped)].float(),
                              capped.float(), atol=0.05)


def test_soft_capped_cascade_decodes_match_reference(cpu_kernels):
    batch = make_batch([(161, 1), (200, 1), (333, 1)], 9, 3, 64, shared_blocks=10, seed=11)
    batch["soft_cap"] = SOFT_CAP
    assert schedule(batch)["shared"] == 2 * 3
    assert_matches_reference(batch)
