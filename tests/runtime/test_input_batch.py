"""build_step_inputs against a plain per-token loop written from the definitions."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.runtime.block_manager import BlockManager
from octavo.runtime.input_batch import build_step_inputs
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import ScheduledSequence
from octavo.runtime.sequence import Sequence


def reference_inputs(scheduled: list[ScheduledSequence], block_size: int) -> dict:
    """The step inputs, one token at a time, straight from the definitions (octavo.ir.ops.attention.paged_attention,
    docs/architecture.md, "The graph and the op set")."""
    input_ids, positions, slots, query_start_loc, seq_lens, logits_indices = [], [], [], [0], [], []
    for item in scheduled:
        seq = item.seq
        for offset in range(item.num_new_tokens):
            position = seq.num_computed_tokens + offset
            input_ids.append(seq.token_ids[position])
            positions.append(position)
            slots.append(seq.block_table[position // block_size] * block_size + position % block_size)
        query_start_loc.append(len(input_ids))
        seq_lens.append(seq.num_computed_tokens + item.num_new_tokens)
        if seq.num_computed_tokens + item.num_new_tokens == seq.num_tokens:
            logits_indices.append(len(input_ids) - 1)
    width = max(len(item.seq.block_table) for item in scheduled)
    tables = [item.seq.block_table + [0] * (width - len(item.seq.block_table)) for item in scheduled]
    return {"input_ids": input_ids, "positions": positions, "slot_mapping": slots,
            "query_start_loc": query_start_loc, "seq_lens": seq_lens, "logits_indices": logits_indices,
            "block_tables": tables}


def check_against_reference(scheduled: list[ScheduledSequence], block_size: int) -> None:
    inputs = build_step_inputs(scheduled, block_size)
    expected = reference_inputs(scheduled, block_size)
    dtypes = {"input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
              "block_tables": torch.int32, "seq_lens": torch.int32, "query_start_loc": torch.int32,
              "logits_indices": torch.int64}
    for name, dtype in dtypes.items():
        tensor = getattr(inputs, name)
        assert tensor.dtype == dtype, f"{name} has dtype {tensor.dtype}"
        assert tensor.tolist() == expected[name], name
    sampled = [index for index, item in enumerate(scheduled) if item.samples]
    assert inputs.sampled_rows == sampled
    assert set(inputs.as_dict()) == set(dtypes)


def make_sequence(name: str, num_tokens: int, num_computed: int, rng: random.Random) -> Sequence:
    token_ids = [rng.randrange(49152) for _ in range(num_tokens)]
    seq = Sequence(name, 0, token_ids, SamplingParams(), detokenizer=None)
    seq.num_computed_tokens = num_computed
    return seq


def scrambled_manager(num_blocks: int, block_size: int, seed: int) -> BlockManager:
    """A block manager whose free list is shuffled, so block ids are not simply 0, 1, 2, ..."""
    manager = BlockManager(num_blocks, block_size)
    order = list(manager.free_block_ids)
    random.Random(seed).shuffle(order)
    manager.free_block_ids.clear()
    manager.free_block_ids.extend(order)
    return manager


def test_mixed_step_of_decode_chunk_and_whole_prefill():
    rng = random.Random(0)
    block_size = 4
    manager = scrambled_manager(64, block_size, seed=1)
    decode = make_sequence("decode", 11, 10, rng)  # one new token, samples
    chunk = make_sequence("chunk", 30, 8, rng)  # 9 of 22 remaining tokens, no sample
    prefill = make_sequence("prefill", 5, 0, rng)  # the whole prompt, samples
    scheduled = [ScheduledSequence(decode, 1), ScheduledSequence(chunk, 9), ScheduledSequence(prefill, 5)]
    for item in scheduled:
        manager.allocate(item.seq, item.seq.num_computed_tokens + item.num_new_tokens)
    check_against_reference(scheduled, block_size)
    inputs = build_step_inputs(scheduled, block_size)
    # Spot values, by hand: the decode token is position 10 in its third block, the chunk starts at 8.
    assert inputs.positions[:3].tolist() == [10, 8, 9]
    assert inputs.query_start_loc.tolist() == [0, 1, 10, 15]
    assert inputs.logits_indices.tolist() == [0, 14]
    assert inputs.slot_mapping[0].item() == decode.block_table[2] * block_size + 2


def test_only_decodes():
    rng = random.Random(1)
    manager = scrambled_manager(32, 16, seed=2)
    scheduled = []
    for index, length in enumerate([1, 16, 17, 40]):
        seq = make_sequence(str(index), length + 1, length, rng)
        manager.allocate(seq, length + 1)
        scheduled.append(ScheduledSequence(seq, 1))
    check_against_reference(scheduled, 16)


def test_step_with_no_sampled_rows():
    rng = random.Random(2)
    manager = scrambled_manager(16, 4, seed=3)
    seq = make_sequence("chunk", 20, 0, rng)
    manager.allocate(seq, 7)
    scheduled = [ScheduledSequence(seq, 7)]
    check_against_reference(scheduled, 4)
    assert build_step_inputs(scheduled, 4).logits_indices.numel() == 0


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 59), st.integers(1, 60)), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 2, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_random_batches_match_the_per_token_loop(shapes, block_size, seed):
    rng = random.Random(seed)
    manager = scrambled_manager(512, block_size, seed)
    scheduled = []
    for index, (num_tokens, computed, new) in enumerate(shapes):
        computed = min(computed, num_tokens - 1)
        new = min(new, num_tokens - computed)
        seq = make_sequence(str(index), num_tokens, computed, rng)
        # Sequences whose table covers more than this step needs, as after earlier allocations.
        manager.allocate(seq, computed + new + rng.randrange(0, 2 * block_size))
        scheduled.append(ScheduledSequence(seq, new))
    check_against_reference(scheduled, block_size)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 80), min_size=1, max_size=9),
    one_token_chunk=st.booleans(),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_decode_steps_match_the_per_token_loop(lengths, one_token_chunk, block_size, seed):
    """Steps of one new token per sequence, every one sampled (the decode shape, built from plain integers),
    and the same with one sequence computing a single prompt token that does not sample."""
    rng = random.Random(seed)
    manager = scrambled_manager(1024, block_size, seed)
    scheduled = []
    for index, length in enumerate(lengths):
        seq = make_sequence(str(index), length + 1, length, rng)
        manager.allocate(seq, length + 1 + rng.randrange(0, 2 * block_size))
        scheduled.append(ScheduledSequence(seq, 1))
    if one_token_chunk:
        seq = make_sequence("chunk", 12, 3, rng)
        manager.allocate(seq, 4)
        scheduled.insert(rng.randrange(len(scheduled) + 1), ScheduledSequence(seq, 1))
    check_against_reference(scheduled, block_size)
