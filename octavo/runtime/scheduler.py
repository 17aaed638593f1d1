"""Continuous-batching scheduler: token budget, chunked prefill, prefix-cache admission, preemption."""

from __future__ import annotations

import bisect
import itertools
import logging
from dataclasses import dataclass, field

from octavo.runtime.block_manager import BlockManager
from octavo.runtime.host_pool import HostBlockPool
from octavo.runtime.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSequence:
    """A sequence's share of one step: `num_new_tokens` query tokens from `num_computed_tokens` on.

    With speculative decoding, the last `len(spec_token_ids)` of them are proposed tokens that
    follow the sequence's newest token (they are not in `seq.token_ids`), verified in this step.
    """

    seq: Sequence
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_real_tokens(self) -> int:
        """Query tokens of the sequence's own token list (the proposed ones excluded)."""
        return self.num_new_tokens - len(self.spec_token_ids)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's newest token, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_real_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """What one step runs, and the KV block moves the engine performs before running it."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host block, device block)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Picks what runs each step under `max_num_batched_tokens` and `max_num_seqs`.

    Order: running decodes first (they are never starved by a long prompt),
    then running prefills that were chunked, then swapped-out sequences,
    then waiting ones by (priority, arrival): a lower priority value runs
    first; equal priorities are first come, first served. A prefill longer
    than the remaining budget is cut into a chunk that continues next step.
    A new sequence first reuses the cached blocks of its prefix. When blocks
    run out, the running sequence with the worst (priority, arrival) is
    preempted: by recompute (its blocks are freed and it is requeued) or,
    in swap mode, by copying its blocks to the host pool and back later.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "recompute", host_pool: HostBlockPool | None = None):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.host_pool = host_pool
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.preemptions = {"recompute": 0, "swap": 0}
        self._order: dict[int, int] = {}
        self._counter = itertools.count()

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    def add(self, seq: Sequence) -> None:
        self._order[id(seq)] = next(self._counter)
        bisect.insort(self.waiting, seq, key=self._queue_key)

    def add_running(self, seq: Sequence) -> None:
        """Put an already-computed sequence (a fork of a running one) straight into the running set."""
        self._order[id(seq)] = next(self._counter)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _queue_key(self, seq: Sequence) -> tuple:
        return (seq.priority, seq.arrival_time, self._order[id(seq)])

    # ---- one step ----

    def schedule(self, proposals: dict[Sequence, list[int]] | None = None) -> SchedulerOutput:
        """`proposals`: speculative tokens to verify after running decodes' newest tokens. They are
        cut to the budget left once every decode has its own token, and to the free blocks: a
        proposal never preempts a sequence."""
        output = SchedulerOutput()
        decodes = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        prefills = [seq for seq in self.running if seq.num_uncomputed_tokens > 1]
        spare = self.max_num_batched_tokens - min(len(decodes), self.max_num_seqs)
        for seq in decodes + prefills:
            budget = self.max_num_batched_tokens - output.num_batched_tokens
            if budget == 0 or len(output.scheduled) == self.max_num_seqs:
                break  # forks (parallel samples, beams) can make the running set larger than max_num_seqs
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            spec = self._fit_proposals(seq, num_new, (proposals or {}).get(seq, ()), min(spare, budget - num_new))
            spare -= len(spec)
            if self._reserve_blocks(seq, num_new, output, len(spec)):
                output.scheduled.append(ScheduledSequence(seq, num_new + len(spec), spec))
        if not output.preempted:
            self._swap_in(output)
        if not output.preempted and not self.swapped:
            self._admit_waiting(output)
        return output

    def _fit_proposals(self, seq: Sequence, num_new: int, proposal, limit: int) -> list[int]:
        """The longest prefix of `proposal` (at most `limit` tokens) whose slots fit in free blocks."""
        if num_new != seq.num_uncomputed_tokens:
            return []  # only a sequence whose newest token is computed this step can verify proposals
        spec = list(proposal[:max(0, limit)])
        end = seq.num_computed_tokens + num_new
        while spec and not self.block_manager.can_allocate(seq, end + len(spec)):
            spec.pop()
        return spec

    def _reserve_blocks(self, seq: Sequence, num_new: int, output: SchedulerOutput, num_spec: int = 0) -> bool:
        """Allocate blocks for `seq` (and `num_spec` proposed tokens after its new ones), preempting
        the worst running sequences while needed. Only the new tokens' blocks enter the prefix cache.

        Sequences with nothing to compute (scored beams waiting for their round to end) go first:
        they lose no work this step, and a beam still to be scored must not wait on them.
        """
        needed = seq.num_computed_tokens + num_new
        while not self.block_manager.can_allocate(seq, needed + num_spec):
            victim = max(self.running, key=lambda other: (other.num_uncomputed_tokens == 0, self._queue_key(other)))
            self.preempt(victim, output)
            output.scheduled = [item for item in output.scheduled if item.seq is not victim]
            if victim is seq:
                return False
        self.block_manager.allocate(seq, needed + num_spec)
        self.block_manager.cache_full_blocks(seq, needed)
        return True

    def _swap_in(self, output: SchedulerOutput) -> None:
        manager = self.block_manager
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            budget = self.max_num_batched_tokens - output.num_batched_tokens
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0 or manager.blocks_for_tokens(seq.num_computed_tokens + num_new) > manager.num_free_blocks:
                return
            self.swapped.pop(0)
            host_blocks, seq.host_block_table = seq.host_block_table, []
            manager.allocate(seq, seq.num_computed_tokens + num_new)
            manager.cache_full_blocks(seq, seq.num_computed_tokens + num_new)
            output.swap_in += list(zip(host_blocks, seq.block_table, strict=False))
            self.host_pool.release(host_blocks)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            output.scheduled.append(ScheduledSequence(seq, num_new))

    def _admit_waiting(self, output: SchedulerOutput) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            budget = self.max_num_batched_tokens - output.num_batched_tokens
            if budget == 0 or not self._admit(self.waiting[0], budget, output):
                return
            self.running.append(self.waiting.pop(0))

    def _admit(self, seq: Sequence, budget: int, output: SchedulerOutput) -> bool:
        """Reuse cached prefix blocks, then allocate the chunk; False (nothing changed) if it does not fit."""
        manager = self.block_manager
        use_cache = manager.enable_prefix_caching and not seq.block_table and not seq.num_computed_tokens \
            and seq.params.prompt_logprobs is None
        hits = manager.match_prefix(seq.token_ids, seq.block_hashes(manager)) if use_cache else []
        computed = len(hits) * manager.block_size
        num_new = min(seq.num_tokens - computed, budget)
        fresh = manager.blocks_for_tokens(computed + num_new) - len(hits)
        evictable_hits = sum(1 for block_id in hits if manager.blocks[block_id].ref_count == 0)
        if fresh > manager.num_free_blocks - evictable_hits:
            return False
        if use_cache:
            manager.take_prefix_hits(seq, hits)
            seq.num_cached_tokens = max(seq.num_cached_tokens, computed)
        manager.allocate(seq, computed + num_new)
        manager.cache_full_blocks(seq, computed + num_new)
        seq.status = SequenceStatus.RUNNING
        output.scheduled.append(ScheduledSequence(seq, num_new))
        return True

    # ---- preemption and finishing ----

    def preempt(self, seq: Sequence, output: SchedulerOutput | None = None) -> None:
        """Take `seq` off the running set: swap its blocks to the host pool, or free them for recompute.

        A sequence with nothing left to compute (a scored beam waiting for its round to end) is
        always recomputed: a swapped sequence only comes back with a chunk to compute.
        """
        self.running.remove(seq)
        self.block_manager.forget_uncomputed_blocks(seq)
        # A block copied-on-write for this step holds nothing yet: swap out its source instead.
        copied_from = self.block_manager.cancel_pending_copies(seq)
        blocks = len(seq.block_table)
        swap = self.preemption_mode == "swap" and seq.num_uncomputed_tokens > 0
        if swap and self.host_pool is not None and self.host_pool.can_take(blocks):
            host_blocks = self.host_pool.take(blocks)
            if output is not None:
                sources = [copied_from.get(block_id, block_id) for block_id in seq.block_table]
                output.swap_out += list(zip(sources, host_blocks, strict=True))
            seq.host_block_table = host_blocks
            self.block_manager.free(seq)
            seq.status = SequenceStatus.SWAPPED
            seq.num_preemptions += 1
            self.swapped.append(seq)
            self.preemptions["swap"] += 1
        else:
            self.block_manager.free(seq)
            seq.reset_for_recompute()
            bisect.insort(self.waiting, seq, key=self._queue_key)
            self.preemptions["recompute"] += 1
        if output is not None:
            output.preempted.append(seq)
        logger.debug("preempted %s (%s)", seq.seq_id, seq.status.value)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark `seq` finished with `status` and release its blocks (device and host)."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        self.block_manager.free(seq)
        if seq.host_block_table and self.host_pool is not None:
            self.host_pool.release(seq.host_block_table)
            seq.host_block_table = []
        seq.status = status
        self._order.pop(id(seq), None)
