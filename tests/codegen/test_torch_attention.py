"""The torch backend's paged attention kernel equals the reference op (octavo::paged_attention).

The reference op itself is checked against a dense definition in
tests/ir/test_paged_attention.py; here the kernel (batched decode rows, one
SDPA call per multi-token row) must give the reference's outputs and cache
writes on mixed batches, and stay right when the pool holds garbage where no
sequence has written (the runtime allocates it uninitialized).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import octavo.ir.ops  # noqa: F401  (registers octavo::paged_attention)
from octavo.codegen.lowering import lower_graph
from octavo.codegen.torch_backend import KERNELS
from octavo.codegen.torch_backend.attention import paged_attention as torch_kernel
from octavo.errors import OctavoError

reference_op = torch.ops.octavo.paged_attention.default
BLOCK_SIZE = 16
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def make_batch(shapes: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype = torch.float32, num_padding: int = 0, seed: int = 0,
               pool_fill: float | None = None) -> dict:
    """Arguments of one call; shapes: (context length, query length) per sequence, padding tokens last.

    Each sequence's context before its query tokens is written into blocks
    picked at random from the pool; every other slot holds `pool_fill`
    (random values when None). Unused block table entries hold block 0.
    """
    generator = torch.Generator().manual_seed(seed)
    num_pool_blocks = sum(math.ceil(length / BLOCK_SIZE) for length, _ in shapes) + 3
    pool_shape = (num_pool_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    if pool_fill is None:
        key_cache, value_cache = (torch.randn(pool_shape, generator=generator) for _ in range(2))
    else:
        key_cache, value_cache = torch.full(pool_shape, pool_fill), torch.full(pool_shape, pool_fill)
    free_blocks = torch.randperm(num_pool_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(shapes), max(math.ceil(length / BLOCK_SIZE) for length, _ in shapes) + 2,
                               dtype=torch.int32)
    queries, keys, values, slots = [], [], [], []
    for row, (context_len, q_len) in enumerate(shapes):
        blocks = torch.tensor([free_blocks.pop() for _ in range(math.ceil(context_len / BLOCK_SIZE))])
        block_tables[row, :len(blocks)] = blocks.to(torch.int32)
        positions = torch.arange(context_len)
        sequence_slots = blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        full_keys = torch.randn(context_len, num_kv_heads, head_dim, generator=generator)
        full_values = torch.randn(context_len, num_kv_heads, head_dim, generator=generator)
        cached = context_len - q_len
        key_cache.view(-1, num_kv_heads, head_dim)[sequence_slots[:cached]] = full_keys[:cached]
        value_cache.view(-1, num_kv_heads, head_dim)[sequence_slots[:cached]] = full_values[:cached]
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=generator))
        keys.append(full_keys[cached:])
        values.append(full_values[cached:])
        slots.append(sequence_slots[cached:])
    queries.append(torch.randn(num_padding, num_heads, head_dim, generator=generator))
    keys.append(torch.randn(num_padding, num_kv_heads, head_dim, generator=generator))
    values.append(torch.randn(num_padding, num_kv_heads, head_dim, generator=generator))
    slots.append(torch.full((num_padding,), -1))
    query_lens = torch.tensor([q_len for _, q_len in shapes])
    return {
        "query": torch.cat(queries).to(dtype), "key": torch.cat(keys).to(dtype), "value": torch.cat(values).to(dtype),
        "key_cache": key_cache.to(dtype), "value_cache": value_cache.to(dtype),
        "slot_mapping": torch.cat(slots).long(), "block_tables": block_tables,
        "seq_lens": torch.tensor([length for length, _ in shapes], dtype=torch.int32),
        "query_start_loc": torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)]).to(torch.int32),
        "scale": 1 / math.sqrt(head_dim), "sliding_window": -1,
    }


def copy_batch(batch: dict) -> dict:
    return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in batch.items()}


def run_both(batch: dict) -> tuple[dict, torch.Tensor, dict, torch.Tensor]:
    """(kernel inputs after the call, kernel output, reference inputs after, reference output)."""
    kernel_batch, reference_batch = copy_batch(batch), copy_batch(batch)
    kernel_output = torch_kernel(**kernel_batch)
    reference_output = reference_op(**reference_batch)
    return kernel_batch, kernel_output, reference_batch, reference_output


def assert_kernel_matches_reference(batch: dict) -> torch.Tensor:
    kernel_batch, kernel_output, reference_batch, reference_output = run_both(batch)
    rows = int(batch["query_start_loc"][-1])  # padding rows have no defined output
    assert kernel_output.shape == reference_output.shape and kernel_output.dtype == reference_output.dtype
    torch.testing.assert_close(kernel_output[:rows], reference_output[:rows], **TOLERANCE[batch["query"].dtype])
    assert torch.equal(kernel_batch["key_cache"], reference_batch["key_cache"])
    assert torch.equal(kernel_batch["value_cache"], reference_batch["value_cache"])
    return kernel_output[:rows]


DECODES = [(15, 1), (16, 1), (17, 1), (40, 1), (1, 1)]
MIXED = [(15, 1), (33, 33), (16, 1), (40, 7), (17, 1), (20, 4), (64, 1), (2, 2)]


@pytest.mark.parametrize("shapes", [DECODES, MIXED, [(50, 9), (37, 16)]], ids=["decodes", "mixed", "chunks"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)], ids=["gqa1", "gqa3", "gqa8"])
def test_matches_reference(shapes, num_heads, num_kv_heads):
    assert_kernel_matches_reference(make_batch(shapes, num_heads, num_kv_heads, head_dim=64, num_padding=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dim_128(dtype):
    assert_kernel_matches_reference(make_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=128, dtype=dtype))


def test_bfloat16_mixed_batch():
    assert_kernel_matches_reference(make_batch(MIXED, 8, 1, head_dim=64, dtype=torch.bfloat16, num_padding=1))


@pytest.mark.parametrize("window", [1, 5, 16, 24])
def test_sliding_window(window):
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64)
    batch["sliding_window"] = window
    windowed = assert_kernel_matches_reference(batch)
    batch["sliding_window"] = -1
    full = assert_kernel_matches_reference(batch)
    assert not torch.allclose(windowed, full)  # the window cuts some context of these sequences


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), -float("inf"), 1e30])
@pytest.mark.parametrize("window", [-1, 5])
def test_garbage_in_unwritten_slots_changes_nothing(fill, window):
    """Slots no sequence wrote (beyond a context's end, in unused blocks) must not influence any output."""
    shapes = [(15, 1), (3, 1), (40, 1), (17, 5), (9, 9)]
    clean = make_batch(shapes, 4, 2, head_dim=64, pool_fill=0.0)
    dirty = make_batch(shapes, 4, 2, head_dim=64, pool_fill=fill)
    clean["sliding_window"] = dirty["sliding_window"] = window
    expected = reference_op(**copy_batch(clean))
    output = torch_kernel(**dirty)
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=2e-5)


def test_unused_block_table_entries_are_not_read():
    """Entries past ceil(seq_len / block_size) are outside the op's definition: any value must do."""
    batch = make_batch(MIXED, 4, 2, head_dim=64)
    lengths = batch["seq_lens"].long()
    used = (lengths + BLOCK_SIZE - 1) // BLOCK_SIZE
    unused = torch.arange(batch["block_tables"].shape[1]).unsqueeze(0) >= used.unsqueeze(1)
    expected = reference_op(**copy_batch(batch))
    for garbage in (-1, 2**30):
        garbage_batch = copy_batch(batch)
        garbage_batch["block_tables"] = batch["block_tables"].masked_fill(unused, garbage)
        torch.testing.assert_close(torch_kernel(**garbage_batch), expected, atol=2e-5, rtol=2e-5)


def test_reference_op_passes_under_the_same_garbage():
    """Sanity of the two tests above: the reference op itself ignores unwritten slots and unused entries."""
    shapes = [(15, 1), (17, 5)]
    clean, dirty = make_batch(shapes, 4, 2, 64, pool_fill=0.0), make_batch(shapes, 4, 2, 64, pool_fill=float("nan"))
    assert torch.equal(reference_op(**clean), reference_op(**dirty))


# ------------------------------------------------------------------------------------------ lowering


def attention_block(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens,
                    query_start_loc):
    attended = reference_op(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens,
                            query_start_loc, 0.125, -1)
    return attended * 2.0


def test_lower_graph_points_octavo_ops_at_torch_kernels():
    batch = make_batch(MIXED, 4, 2, head_dim=64)
    names = [name for name in batch if name not in ("scale", "sliding_window")]
    graph_module = make_fx(attention_block)(*[batch[name].clone() for name in names])
    assert [node.target for node in graph_module.graph.nodes if node.op == "call_function"].count(reference_op) == 1
    expected_inputs = [batch[name].clone() for name in names]
    expected = graph_module(*expected_inputs)
    lowered = lower_graph(graph_module, "torch")
    targets = [node.target for node in lowered.graph.nodes if node.op == "call_function"]
    assert reference_op not in targets
    assert targets.count(KERNELS[reference_op]) == 1
    assert torch.ops.aten.mul.Tensor in targets  # ATen ops stay as they are
    inputs = [batch[name].clone() for name in names]
    torch.testing.assert_close(lowered(*inputs), expected, atol=4e-5, rtol=2e-5)
    assert torch.equal(inputs[names.index("key_cache")], expected_inputs[names.index("key_cache")])


def test_lower_graph_rejects_unknown_backend():
    graph_module = make_fx(lambda x: x + 1)(torch.zeros(2))
    with pytest.raises(OctavoError, match=r"unknown backend 'tpu': choose one of torch"):
        lower_graph(graph_module, "tpu")

