"""BlockManager: the physical KV blocks, their reference counts and the free list."""

from __future__ import annotations

from collections import deque

from octavo.runtime.sequence import Sequence


class BlockManager:
    """Owns `num_blocks` KV blocks of `block_size` token slots each.

    A sequence's `block_table` lists its blocks in order; token i of the
    sequence lives in block `block_table[i // block_size]` at offset
    `i % block_size`. A block is free when its reference count is 0.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its table covers `num_tokens` tokens."""
        return max(0, self.blocks_for_tokens(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq.block_table` to cover `num_tokens` tokens (caller checked can_allocate)."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {missing}, have {self.num_free_blocks}")
        for _ in range(missing):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (a block returns to the free list when nothing else holds it)."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = []
