"""HostBlockPool: block ids of the host-side KV pool that swap-mode preemption copies into."""

from __future__ import annotations

from collections import deque


class HostBlockPool:
    """A free list of `num_blocks` host blocks (the tensors live in KVCache.host_tensors)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def can_take(self, count: int) -> bool:
        return count <= len(self.free_block_ids)

    def take(self, count: int) -> list[int]:
        if count > len(self.free_block_ids):
            raise RuntimeError(f"host KV pool exhausted: need {count}, have {len(self.free_block_ids)}")
        return [self.free_block_ids.popleft() for _ in range(count)]

    def release(self, block_ids: list[int]) -> None:
        self.free_block_ids.extend(block_ids)
