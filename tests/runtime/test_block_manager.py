"""BlockManager: block accounting checked against its definition (refcount = references in block tables)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from octavo.runtime.block_manager import BlockManager
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.sequence import Sequence


def make_sequence(name: str, prompt_length: int = 1) -> Sequence:
    """A sequence with `prompt_length` prompt tokens; the block manager never reads its detokenizer."""
    return Sequence(name, 0, list(range(prompt_length)), SamplingParams(), detokenizer=None)


def check_accounting(manager: BlockManager, sequences: list[Sequence]) -> None:
    """The invariants the block manager promises, computed from the block tables alone."""
    references = [0] * manager.num_blocks
    for seq in sequences:
        for block_id in seq.block_table:
            references[block_id] += 1
    assert manager.ref_counts == references
    # A free block is either plain free or, holding a full block of tokens, kept for the prefix cache.
    free = list(manager.free_block_ids) + list(manager.cached_free_blocks)
    assert len(free) == len(set(free)), "a block is in the free lists twice"
    assert not [block for block in free if references[block]], "a referenced block is also free"
    unreferenced = {block for block in range(manager.num_blocks) if references[block] == 0}
    assert set(free) == unreferenced, "an unreferenced block is missing from the free lists"
    assert manager.num_free_blocks + manager.num_used_blocks == manager.num_blocks


@pytest.mark.parametrize(("num_tokens", "expected"), [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for_tokens_is_ceiling_division(num_tokens, expected):
    assert BlockManager(8, 16).blocks_for_tokens(num_tokens) == expected


def test_allocate_extends_the_table_only_by_missing_blocks():
    manager = BlockManager(num_blocks=6, block_size=4)
    seq = make_sequence("a")
    manager.allocate(seq, 5)
    assert seq.block_table == [0, 1]
    manager.allocate(seq, 8)  # still fits in two blocks
    assert seq.block_table == [0, 1]
    manager.allocate(seq, 9)
    assert seq.block_table == [0, 1, 2]
    manager.allocate(seq, 3)  # never shrinks
    assert seq.block_table == [0, 1, 2]
    assert manager.num_free_blocks == 3
    check_accounting(manager, [seq])


def test_free_returns_every_block_and_empties_the_table():
    manager = BlockManager(num_blocks=4, block_size=2)
    first, second = make_sequence("a"), make_sequence("b")
    manager.allocate(first, 3)
    manager.allocate(second, 4)
    assert manager.num_free_blocks == 0
    check_accounting(manager, [first, second])
    manager.free(first)
    assert first.block_table == []
    assert manager.num_free_blocks == 2
    check_accounting(manager, [first, second])
    manager.free(second)
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.ref_counts == [0] * 4


def test_freed_blocks_are_reused():
    manager = BlockManager(num_blocks=2, block_size=4)
    first = make_sequence("a")
    manager.allocate(first, 8)
    manager.free(first)
    second = make_sequence("b")
    manager.allocate(second, 8)
    assert sorted(second.block_table) == [0, 1]
    check_accounting(manager, [first, second])


def test_can_allocate_counts_only_missing_blocks_against_free_ones():
    manager = BlockManager(num_blocks=3, block_size=4)
    seq, other = make_sequence("a"), make_sequence("b")
    assert manager.can_allocate(seq, 12)
    assert not manager.can_allocate(seq, 13)
    manager.allocate(seq, 8)
    assert manager.can_allocate(seq, 12)  # one more block: one is free
    assert not manager.can_allocate(seq, 13)
    assert manager.can_allocate(other, 4)
    assert not manager.can_allocate(other, 5)
    assert manager.num_blocks_needed(seq, 8) == 0
    assert manager.num_blocks_needed(seq, 16) == 2


def test_allocating_past_the_pool_raises_and_changes_nothing():
    manager = BlockManager(num_blocks=2, block_size=4)
    seq = make_sequence("a")
    manager.allocate(seq, 4)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        manager.allocate(seq, 12)
    assert seq.block_table == [0]
    assert manager.num_free_blocks == 1
    check_accounting(manager, [seq])


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / free sequences against a small pool."""

    sequences = Bundle("sequences")

    def __init__(self):
        super().__init__()
        self.manager = BlockManager(num_blocks=12, block_size=4)
        self.live: list[Sequence] = []
        self.token_counts: dict[int, int] = {}
        self.counter = 0

    @rule(target=sequences, num_tokens=st.integers(1, 30))
    def add(self, num_tokens):
        self.counter += 1
        seq = make_sequence(f"s{self.counter}")
        self._grow(seq, num_tokens)
        self.live.append(seq)
        return seq

    @rule(seq=sequences, extra=st.integers(1, 9))
    def append(self, seq, extra):
        if seq in self.live:
            self._grow(seq, self.token_counts[id(seq)] + extra)

    @rule(seq=sequences)
    def free(self, seq):
        self.manager.free(seq)
        if seq in self.live:
            self.live.remove(seq)
        assert seq.block_table == []

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        missing = self.manager.num_blocks_needed(seq, num_tokens)
        if self.manager.can_allocate(seq, num_tokens):
            self.manager.allocate(seq, num_tokens)
            self.token_counts[id(seq)] = num_tokens
            assert len(seq.block_table) == self.manager.blocks_for_tokens(num_tokens)
        else:
            assert missing > self.manager.num_free_blocks
            with pytest.raises(RuntimeError):
                self.manager.allocate(seq, num_tokens)
            self.token_counts.setdefault(id(seq), 0)

    @invariant()
    def accounting_holds(self):
        check_accounting(self.manager, self.live)

    def teardown(self):
        for seq in self.live:
            self.manager.free(seq)
        assert self.manager.num_free_blocks == self.manager.num_blocks
        assert self.manager.ref_counts == [0] * self.manager.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=10), st.integers(1, 8))
def test_allocations_in_any_order_never_share_a_block(lengths, block_size):
    manager = BlockManager(num_blocks=20, block_size=block_size)
    allocated = []
    for index, length in enumerate(lengths):
        seq = make_sequence(str(index))
        if manager.can_allocate(seq, length):
            manager.allocate(seq, length)
            allocated.append(seq)
    tables = [block for seq in allocated for block in seq.block_table]
    assert len(tables) == len(set(tables))
    check_accounting(manager, allocated)
    for seq in reversed(allocated):
        manager.free(seq)
    assert manager.num_free_blocks == manager.num_blocks
