"""Continuous-batching scheduler with a token budget and chunked prefill."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from octavo.runtime.block_manager import BlockManager
from octavo.runtime.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSequence:
    """A sequence's share of one step: `num_new_tokens` query tokens from `num_computed_tokens` on."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's newest token, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Picks what runs each step under `max_num_batched_tokens` and `max_num_seqs`.

    Order: running decodes first (they are never starved), then running
    prefills that were chunked, then waiting sequences in arrival order.
    A prefill longer than the remaining budget is cut into a chunk and
    continues next step. When blocks run out, the newest running sequence
    is preempted by recompute: its blocks are freed and it goes back to the
    front of the waiting queue.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        decodes = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        prefills = [seq for seq in self.running if seq.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            budget = self.max_num_batched_tokens - output.num_batched_tokens
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            if self._reserve_blocks(seq, num_new, output):
                output.scheduled.append(ScheduledSequence(seq, num_new))
        if not output.preempted:
            self._admit_waiting(self.max_num_batched_tokens - output.num_batched_tokens, output)
        return output

    def _reserve_blocks(self, seq: Sequence, num_new: int, output: SchedulerOutput) -> bool:
        """Allocate blocks for `seq`, preempting the newest running sequences if needed."""
        needed = seq.num_computed_tokens + num_new
        while not self.block_manager.can_allocate(seq, needed):
            victim = self.running[-1]
            self.preempt(victim)
            output.preempted.append(victim)
            output.scheduled = [item for item in output.scheduled if item.seq is not victim]
            if victim is seq:
                return False
        self.block_manager.allocate(seq, needed)
        return True

    def _admit_waiting(self, budget: int, output: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, seq.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            output.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

    def preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: free the blocks and requeue `seq` at the front of the waiting queue."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        logger.debug("preempted %s (recompute)", seq.seq_id)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark `seq` finished with `status` and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
