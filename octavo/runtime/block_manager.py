"""BlockManager: physical KV blocks, reference counts, the prefix cache and copy-on-write."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from octavo.runtime.prefix_cache_stats import PrefixCacheStats
from octavo.runtime.sequence import Sequence

HashFunction = Callable[[int | None, tuple[int, ...]], int]


def default_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block: covers its parent's hash, so equal hashes mean equal whole prefixes."""
    return hash((parent_hash, token_ids))


@dataclass
class Block:
    """One physical block. The cache fields are set while it is in the prefix cache.

    `cache_id` is unique to this entry into the cache (a block cached again gets a new one);
    `parent_cache_id` is the cache_id of the block that preceded it when its K/V was computed,
    so a hit can check that its whole prefix is the one confirmed so far, not only a hash.
    """

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    cache_id: int | None = None
    parent_cache_id: int | None = None


@dataclass
class BlockCopy:
    """A block content copy the engine performs before the step runs (copy-on-write)."""

    source: int
    destination: int


@dataclass
class BlockManager:
    """Owns `num_blocks` KV blocks of `block_size` token slots each.

    A sequence's `block_table` lists its blocks in order; token i of the
    sequence lives in block `block_table[i // block_size]` at offset
    `i % block_size`. A block's reference count is the number of block
    tables that hold it. A block is free when its count is 0; a free block
    that holds a full block of tokens stays in the prefix cache (keyed by
    the hash chain of its tokens) until a fresh block is needed, then the
    least recently freed one is evicted. Blocks shared by several sequences
    (parallel samples, beams) are copied before a sequence writes into them.
    """

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = False
    hash_function: HashFunction = default_block_hash
    blocks: list[Block] = field(init=False)
    free_block_ids: deque[int] = field(init=False)
    cached_free_blocks: OrderedDict[int, None] = field(init=False)
    hash_to_block: dict[int, int] = field(init=False)
    pending_copies: list[BlockCopy] = field(init=False)
    stats: PrefixCacheStats = field(init=False)
    _cache_ids: itertools.count = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._cache_ids = itertools.count()
        self.blocks = [Block(block_id) for block_id in range(self.num_blocks)]
        self.free_block_ids = deque(range(self.num_blocks))
        self.cached_free_blocks = OrderedDict()
        self.hash_to_block = {}
        self.pending_copies = []
        self.stats = PrefixCacheStats()

    # ---- counts ----

    @property
    def ref_counts(self) -> list[int]:
        return [block.ref_count for block in self.blocks]

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: never-used/free ones plus evictable cached ones."""
        return len(self.free_block_ids) + len(self.cached_free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold reusable prefix-cache contents."""
        return len(self.cached_free_blocks)

    @property
    def prefix_cache_queries_tokens(self) -> int:
        return self.stats.queried_tokens

    @property
    def prefix_cache_hits_tokens(self) -> int:
        return self.stats.hit_tokens

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ----

    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Fresh blocks `seq` needs so it can hold `num_tokens` and write its uncomputed ones.

        Counts the blocks missing from its table plus the shared blocks in
        its write range, which copy-on-write will replace.
        """
        missing = max(0, self.blocks_for_tokens(num_tokens) - len(seq.block_table))
        return missing + len(self._shared_blocks_to_write(seq, num_tokens))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Make `seq` able to hold `num_tokens` tokens and write slots from num_computed_tokens on.

        Extends the block table with fresh blocks and replaces shared blocks
        in the write range by private copies (queued in `pending_copies`).
        The caller checked can_allocate.
        """
        needed = self.num_blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {needed}, have {self.num_free_blocks}")
        for index in self._shared_blocks_to_write(seq, num_tokens):
            shared = seq.block_table[index]
            private = self._take_free_block()
            self.pending_copies.append(BlockCopy(shared, private))
            self._release(shared)
            seq.block_table[index] = private
        while len(seq.block_table) < self.blocks_for_tokens(num_tokens):
            seq.block_table.append(self._take_free_block())

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`; the last reference returns a block to the free or cached pool."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks of `seq` past the ones that hold its first `num_tokens` tokens.

        Speculative decoding allocates slots for proposed tokens; when they are rejected the
        sequence is shortened and the blocks that held only rejected tokens are freed.
        """
        keep = self.blocks_for_tokens(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the same blocks as `parent` (shared, one more reference each)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)

    def take_pending_copies(self) -> list[BlockCopy]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def cancel_pending_copies(self, seq: Sequence) -> dict[int, int]:
        """Drop the queued copy-on-write copies into `seq`'s blocks; returns {destination: source}.

        For a sequence preempted in the step that queued them: its step does not run, and a freed
        destination may be handed out again in the same step (two copies into one block). The
        source still holds the contents when a swap-out reads it (swap-outs run before copies).
        """
        own = set(seq.block_table)
        cancelled = {copy.destination: copy.source for copy in self.pending_copies if copy.destination in own}
        self.pending_copies = [copy for copy in self.pending_copies if copy.destination not in own]
        return cancelled

    def _shared_blocks_to_write(self, seq: Sequence, num_tokens: int) -> list[int]:
        first = seq.num_computed_tokens // self.block_size
        last = min(len(seq.block_table), self.blocks_for_tokens(num_tokens))
        return [index for index in range(first, last) if self.blocks[seq.block_table[index]].ref_count > 1]

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.cached_free_blocks.popitem(last=False)
            self._forget_cached(self.blocks[block_id])
            self.stats.evictions += 1
        self.blocks[block_id].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:
            raise RuntimeError(f"block {block_id} released more often than referenced")
        if block.ref_count == 0:
            if block.block_hash is not None:
                self.cached_free_blocks[block_id] = None  # most recently freed last: evicted last
            else:
                self.free_block_ids.append(block_id)

    # ---- prefix cache ----

    def take_prefix_hits(self, seq: Sequence, hits: list[int]) -> None:
        """Give a new sequence the cached blocks `hits` (from match_prefix) as the start of its table.

        Records the lookup in `stats` (only admitted lookups count, once each).
        """
        self._count_collision(seq, len(hits))
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached_free_blocks[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        reusable = (seq.num_tokens - 1) // self.block_size
        self.stats.record_lookup(seq.num_tokens, seq.num_computed_tokens,
                                 seq.num_tokens - reusable * self.block_size)

    def _count_collision(self, seq: Sequence, num_hits: int) -> None:
        """Count a hash collision if the lookup stopped at a cached block whose hash matched but whose
        tokens differ. (Same tokens after another instance of the parent is a stale chain, not a collision.)
        """
        hashes = seq.block_hashes(self)
        if num_hits >= min(len(hashes), (seq.num_tokens - 1) // self.block_size):
            return
        block_id = self.hash_to_block.get(hashes[num_hits])
        tokens = tuple(seq.token_ids[num_hits * self.block_size:(num_hits + 1) * self.block_size])
        if block_id is not None and self.blocks[block_id].token_ids != tokens:
            self.stats.hash_collisions += 1

    def match_prefix(self, token_ids: SequenceOf[int], block_hashes: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids`, each hit confirmed by its tokens.

        A hit must equal the block's tokens and have been computed after the
        previous hit (same cache entry), so the whole prefix is confirmed
        token by token and a hash collision never reuses wrong contents. At
        least the last token is always left to compute (its logits are
        needed): a fully cached prompt reuses all but its last block. Changes
        nothing (a sequence that does not fit this step looks up again later).
        """
        reusable = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        parent_cache_id = None
        for index, block_hash in enumerate(block_hashes[:reusable]):
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            tokens = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            if block.token_ids != tokens or block.parent_cache_id != parent_cache_id:
                break
            hits.append(block_id)
            parent_cache_id = block.cache_id
        return hits

    def cache_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Enter every block of `seq` whose first `num_tokens` tokens (default: the computed ones) fill it.

        The scheduler calls this when it allocates a step's blocks, with the
        tokens the step will have computed: the step writes every token's K/V
        before any attention reads, so a sequence admitted later in the same
        step may already reuse these blocks. A block is entered with the cache
        entry of the block before it (or of that block's cached twin, same
        tokens after the same prefix); the chain stops at a block whose hash
        another prefix owns (a collision). Blocks entered by an earlier call
        are not visited again (`seq.cache_walk` records how far it got, and is
        checked before use), so a step pays only for the blocks that just filled.
        """
        if not self.enable_prefix_caching:
            return
        hashes = seq.block_hashes(self)
        num_tokens = seq.num_computed_tokens if num_tokens is None else num_tokens
        num_full = min(num_tokens // self.block_size, len(hashes), len(seq.block_table))
        start, parent_cache_id = self._resume_point(seq, hashes)
        for index in range(start, num_full):
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is None:
                tokens = tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])
                twin_id = self.hash_to_block.get(hashes[index])
                if twin_id is None:
                    block.block_hash = hashes[index]
                    block.parent_hash = hashes[index - 1] if index else None
                    block.token_ids = tokens
                    block.cache_id = next(self._cache_ids)
                    block.parent_cache_id = parent_cache_id
                    self.hash_to_block[block.block_hash] = block.block_id
                else:
                    twin = self.blocks[twin_id]
                    if twin.token_ids != tokens or twin.parent_cache_id != parent_cache_id:
                        return  # another prefix owns this hash (a collision): the chain cannot continue
                    block = twin  # the same contents are cached in another block: continue from it
            parent_cache_id = block.cache_id
            seq.cache_walk = (index + 1, seq.block_table[index], parent_cache_id)

    def _resume_point(self, seq: Sequence, hashes: list[int]) -> tuple[int, int | None]:
        """(first block to visit, cache id of the block before it) from `seq.cache_walk`, if still valid.

        Valid when the last block it entered is still at its place in the table with the same cache entry
        (its own, or its twin's); entries are unique, so the chain before it is unchanged too.
        """
        walk = seq.cache_walk
        if walk is None:
            return 0, None
        count, block_id, cache_id = walk
        if count > len(seq.block_table) or seq.block_table[count - 1] != block_id or count > len(hashes):
            return 0, None
        block = self.blocks[block_id]
        if block.block_hash is None:
            twin_id = self.hash_to_block.get(hashes[count - 1])
            block = self.blocks[twin_id] if twin_id is not None else block
        return (count, cache_id) if block.cache_id == cache_id else (0, None)

    def forget_uncomputed_blocks(self, seq: Sequence) -> None:
        """Take blocks of `seq` that were cached ahead of their computation out of the prefix cache.

        Used when a sequence is preempted in the step that allocated them: its
        step never runs, so those blocks never receive their contents.
        """
        first_uncomputed = seq.num_computed_tokens // self.block_size
        for block_id in seq.block_table[first_uncomputed:]:
            block = self.blocks[block_id]
            if block.block_hash is not None and block.ref_count == 1:
                self._forget_cached(block)

    def _forget_cached(self, block: Block) -> None:
        if self.hash_to_block.get(block.block_hash) == block.block_id:
            del self.hash_to_block[block.block_hash]
        block.block_hash = block.parent_hash = block.token_ids = None
        block.cache_id = block.parent_cache_id = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (free cached blocks become plain free blocks)."""
        for block_id in list(self.cached_free_blocks):
            self._forget_cached(self.blocks[block_id])
            self.free_block_ids.append(block_id)
        self.cached_free_blocks.clear()
        for block in self.blocks:
            if block.block_hash is not None:
                self._forget_cached(block)
