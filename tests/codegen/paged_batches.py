"""Arguments of paged_attention calls for the kernel tests: mixed batches, shared prefixes, any cache dtype."""

from __future__ import annotations

import math

import torch

from octavo.ir.ops.attention import QUANTIZED_CACHE_MAX, quantize_cache_vectors

# fp32: a few float32 ulps of accumulated rounding (the kernel sums in another order than the reference);
# bf16 / fp16: the output is rounded to the 16-bit type once, so a result next to a rounding boundary
# can land one ulp away: 2^-8 (bf16) and 2^-11 (fp16) relative, for outputs of magnitude below ~4.
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1.6e-2, "rtol": 8e-3},
             torch.float16: {"atol": 2e-3, "rtol": 1e-3}}


def make_batch(shapes: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, *,
               block_size: int = 16, dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None,
               num_padding: int = 0, shared_blocks: int = 0, seed: int = 0, sliding_window: int = -1) -> dict:
    """Keyword arguments of one call; shapes: (context length, query length) per sequence.

    Sequence b's context before its query tokens is already cached (quantized with its scales for
    int8/fp8 caches); its blocks come from a shuffled pool, except that the first `shared_blocks`
    blocks of every sequence are the same physical blocks holding one common prefix, as prefix
    caching leaves them. Every slot no sequence wrote holds NaN (NaN scales for quantized caches),
    which no result may depend on. `num_padding` trailing tokens have slot -1 and no sequence.
    """
    generator = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    counts = [math.ceil(length / block_size) for length, _ in shapes]
    assert all(length > shared_blocks * block_size for length, _ in shapes), "each sequence extends the prefix"
    num_blocks = shared_blocks + sum(count - shared_blocks for count in counts) + 3
    pool = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    tables = torch.zeros(len(shapes), max(counts) + 1, dtype=torch.int32)
    used = shared_blocks
    for row, count in enumerate(counts):
        tables[row, :shared_blocks] = pool[:shared_blocks]
        tables[row, shared_blocks:count] = pool[used:used + count - shared_blocks]
        used += count - shared_blocks
    prefix = shared_blocks * block_size
    common = [torch.randn(prefix, num_kv_heads, head_dim, generator=generator) for _ in range(2)]
    rows = {"key": [], "value": [], "query": []}
    cached = {"key": [], "value": []}
    slots, cached_slots = [], []
    for row, (length, q_len) in enumerate(shapes):
        positions = torch.arange(length)
        seq_slots = tables[row].long()[positions // block_size] * block_size + positions % block_size
        own = [torch.randn(length - prefix, num_kv_heads, head_dim, generator=generator) for _ in range(2)]
        full = {"key": torch.cat([common[0], own[0]]), "value": torch.cat([common[1], own[1]])}
        for name in ("key", "value"):
            cached[name].append(full[name][:length - q_len])
            rows[name].append(full[name][length - q_len:])
        rows["query"].append(torch.randn(q_len, num_heads, head_dim, generator=generator))
        cached_slots.append(seq_slots[:length - q_len])
        slots.append(seq_slots[length - q_len:])
    rows["query"].append(torch.randn(num_padding, num_heads, head_dim, generator=generator))
    for name in ("key", "value"):
        rows[name].append(torch.randn(num_padding, num_kv_heads, head_dim, generator=generator))
    slots.append(torch.full((num_padding,), -1, dtype=torch.int64))
    batch = {name: torch.cat(parts).to(dtype) for name, parts in rows.items()}
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    written = torch.cat(cached_slots)
    for name in ("key", "value"):
        context = torch.cat(cached[name]).to(dtype)  # the earlier steps' rows, as the model produced them
        if cache_dtype in QUANTIZED_CACHE_MAX:
            if cache_dtype == torch.int8:
                cache = torch.randint(-128, 128, shape, generator=generator, dtype=torch.int8)
            else:
                cache = torch.full(shape, float("nan")).to(cache_dtype)
            scales = torch.full(shape[:3], float("nan"))
            values, row_scales = quantize_cache_vectors(context, cache_dtype)
            cache.view(-1, num_kv_heads, head_dim)[written] = values
            scales.view(-1, num_kv_heads)[written] = row_scales
            batch[f"{name}_scale_cache"] = scales
        else:
            cache = torch.full(shape, float("nan"), dtype=cache_dtype)
            cache.view(-1, num_kv_heads, head_dim)[written] = context.to(cache_dtype)
        batch[f"{name}_cache"] = cache
    starts = torch.zeros(len(shapes) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor([q_len for _, q_len in shapes]).cumsum(0)
    batch.update(slot_mapping=torch.cat(slots), block_tables=tables,
                 seq_lens=torch.tensor([length for length, _ in shapes], dtype=torch.int32), query_start_loc=starts,
                 scale=0.7 / math.sqrt(head_dim), sliding_window=sliding_window)
    return batch


def copy_batch(batch: dict) -> dict:
    return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in batch.items()}


def unshare_blocks(batch: dict) -> dict:
    """The same call with every sequence's blocks copied to blocks of its own: equal contents, nothing shared."""
    result = copy_batch(batch)
    tables, lengths = batch["block_tables"], batch["seq_lens"]
    block_size = batch["key_cache"].shape[1]
    pools = [name for name in ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache") if name in batch]
    owners: dict[int, int] = {}
    copies = []
    new_tables = tables.clone()
    next_block = batch["key_cache"].shape[0]
    for row in range(tables.shape[0]):
        for column in range(math.ceil(int(lengths[row]) / block_size)):
            block = int(tables[row, column])
            if owners.setdefault(block, row) != row:
                copies.append(block)
                new_tables[row, column] = next_block
                next_block += 1
    for name in pools:
        result[name] = torch.cat([batch[name], batch[name][torch.tensor(copies, dtype=torch.long)]])
    result["block_tables"] = new_tables
    # Slots written this step stay where they are: a sequence only writes its own (unshared) blocks.
    return result
