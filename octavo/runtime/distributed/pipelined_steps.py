"""Several batches in flight through a pipeline, so that no stage idles while another computes.

With P stages and one batch at a time, each stage computes 1/P of the time.
Like vLLM's virtual engines, the engine here keeps up to `depth` batches in
flight: a step schedules a new batch from the sequences that are *not* in
flight, runs stage 0 of it on rank 0 (while the later stages still work on
the batches before it), and only then waits for the oldest batch's logits,
samples them and returns its outputs.

Why this is correct: every stage runs the batches in the order rank 0
submitted them, so a block a later batch reads (a cached prefix, say) was
written by the earlier batch on that stage first; a sequence in flight is
hidden from the scheduler, so it is neither scheduled twice nor preempted
while a stage may still write its blocks; a request aborted while in flight
is skipped when its logits arrive. Hidden sequences count against
max_num_seqs, so the batches in flight together stay within it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from octavo.runtime.input_batch import StepInputs, build_step_inputs
from octavo.runtime.outputs import RequestOutput
from octavo.runtime.scheduler import SchedulerOutput
from octavo.runtime.step_record import StepRecord


@dataclass
class _Batch:
    schedule: SchedulerOutput
    inputs: StepInputs
    handle: object
    computed_before: list[int]


class PipelinedSteps:
    """`step()` for an engine whose executor is a pipeline (see the module docstring)."""

    def __init__(self, engine, depth: int):
        self.engine = engine
        self.depth = depth
        self.in_flight: deque[_Batch] = deque()

    def step(self) -> list[RequestOutput]:
        submitted = len(self.in_flight) < self.depth and self._submit()
        if not self.in_flight:
            if self.engine.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress although requests are waiting")
            return []
        if submitted and len(self.in_flight) < self.depth:
            return []  # room for one more batch before waiting on the oldest
        return self._collect()

    def _submit(self) -> bool:
        engine = self.engine
        schedule = self._schedule()
        if schedule.is_empty:
            return False
        engine._move_blocks(schedule)
        inputs = build_step_inputs(schedule.scheduled, engine.block_manager.block_size)
        feed = {**inputs.to(engine.device).as_dict(), **engine.kv_cache.tensors}
        handle = engine.parallel.submit(feed)
        computed_before = [item.seq.num_computed_tokens for item in schedule.scheduled]
        for item in schedule.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            engine.block_manager.cache_full_blocks(item.seq)
        self.in_flight.append(_Batch(schedule, inputs, handle, computed_before))
        return True

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next batch from the sequences that are not in flight."""
        scheduler = self.engine.scheduler
        busy = {id(item.seq) for batch in self.in_flight for item in batch.schedule.scheduled}
        hidden = [seq for seq in scheduler.running if id(seq) in busy]
        if not hidden:
            return scheduler.schedule()
        limit = scheduler.max_num_seqs
        scheduler.running = [seq for seq in scheduler.running if id(seq) not in busy]
        scheduler.max_num_seqs = max(0, limit - len(hidden))
        try:
            return scheduler.schedule() if scheduler.max_num_seqs else SchedulerOutput()
        finally:
            scheduler.max_num_seqs = limit
            scheduler.running += hidden

    def _collect(self) -> list[RequestOutput]:
        engine = self.engine
        batch = self.in_flight.popleft()
        logits = engine.parallel.collect(batch.handle)
        engine.last_step = StepRecord(batch.schedule, batch.inputs, logits)
        engine.num_steps += 1
        scheduled = batch.schedule.scheduled
        for index, (first_row, count) in batch.inputs.prompt_rows.items():
            seq = scheduled[index].seq
            if not seq.is_finished and seq.request_id in engine.requests:
                engine.outputs.add_prompt_logprobs(engine.requests[seq.request_id],
                                                   logits[first_row:first_row + count], batch.computed_before[index])
        rows = []
        for row, index in enumerate(batch.inputs.sampled_rows):
            seq = scheduled[index].seq
            if seq.is_finished:
                continue  # aborted while its batch was in flight
            rows.append((seq, row))
            rows += [(sibling, row) for sibling in engine._fork_siblings(seq)]
        engine.outputs.sample_and_append(rows, logits)
        return engine._collect_outputs({item.seq.request_id for item in scheduled
                                        if item.seq.request_id in engine.requests})
