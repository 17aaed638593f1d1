"""Scheduler: token budget, decode priority, chunked prefill, max_num_seqs, FCFS and preemption.

Sequences are driven by hand the way the engine drives them: after a step
every scheduled sequence's computed count advances, and a sequence whose
step reached its newest token gets one new token appended.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.runtime.block_manager import BlockManager
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import Scheduler, SchedulerOutput
from octavo.runtime.sequence import Sequence, SequenceStatus

NEXT_TOKEN = 7


def make_sequence(name: str, prompt_length: int) -> Sequence:
    """A sequence with `prompt_length` prompt tokens; the scheduler never reads its detokenizer."""
    return Sequence(name, 0, list(range(100, 100 + prompt_length)), SamplingParams(), detokenizer=None)


def advance(output: SchedulerOutput) -> list[Sequence]:
    """Apply a step as the engine does; returns the sequences that got a new token."""
    sampled = [item.seq for item in output.scheduled if item.samples]
    for item in output.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
    for seq in sampled:
        seq.append_token(NEXT_TOKEN)
    return sampled


def shares(output: SchedulerOutput) -> dict[str, int]:
    return {item.seq.request_id: item.num_new_tokens for item in output.scheduled}


def check_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """Per-step promises: budget, sequence cap, block coverage, no block in two tables."""
    assert output.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert len(output.scheduled) <= scheduler.max_num_seqs
    assert len(scheduler.running) <= scheduler.max_num_seqs
    manager = scheduler.block_manager
    for item in output.scheduled:
        assert item.num_new_tokens >= 1
        assert item.seq.status is SequenceStatus.RUNNING
        needed = item.seq.num_computed_tokens + item.num_new_tokens
        assert needed <= item.seq.num_tokens
        assert len(item.seq.block_table) >= manager.blocks_for_tokens(needed)
    blocks = [block for seq in scheduler.running for block in seq.block_table]
    assert len(blocks) == len(set(blocks))
    assert all(not seq.block_table for seq in scheduler.waiting)
    assert manager.num_used_blocks == len(blocks)


def test_prompt_that_fits_is_prefilled_in_one_step_then_decoded():
    scheduler = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    seq = make_sequence("a", 10)
    scheduler.add(seq)
    output = scheduler.schedule()
    assert shares(output) == {"a": 10}
    assert output.scheduled[0].samples
    assert len(seq.block_table) == 3
    advance(output)
    for _ in range(3):
        output = scheduler.schedule()
        assert shares(output) == {"a": 1}
        assert output.scheduled[0].samples
        advance(output)
    assert seq.num_tokens == 14 and seq.num_computed_tokens == 13
    assert len(seq.block_table) == 4


def test_long_prompt_is_chunked_while_others_keep_decoding():
    budget = 8
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=budget)
    decoders = [make_sequence(name, 3) for name in ("a", "b")]
    for seq in decoders:
        scheduler.add(seq)
    advance(scheduler.schedule())  # both prefilled together (6 tokens)
    long_prompt = make_sequence("long", 30)
    scheduler.add(long_prompt)
    chunks = []
    while long_prompt.num_output_tokens == 0:
        output = scheduler.schedule()
        check_step(scheduler, output)
        share = shares(output)
        assert share["a"] == 1 and share["b"] == 1, "a decode was starved by the long prompt"
        assert [item.seq.request_id for item in output.scheduled[:2]] == ["a", "b"], "decodes go first"
        chunks.append(share["long"])
        assert output.num_batched_tokens == budget or sum(chunks) == 30
        advance(output)
    assert chunks == [6, 6, 6, 6, 6]
    assert long_prompt.num_computed_tokens == 30


def test_decodes_are_scheduled_before_an_earlier_admitted_prefill():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    first, second = make_sequence("first", 5), make_sequence("second", 2)
    scheduler.add(first)
    scheduler.add(second)
    advance(scheduler.schedule())
    # `first` must recompute eleven tokens (say it was given them by hand); `second` decodes one.
    first.token_ids += [NEXT_TOKEN] * 10
    scheduler.max_num_batched_tokens = 5
    output = scheduler.schedule()
    assert [(item.seq.request_id, item.num_new_tokens) for item in output.scheduled] == [("second", 1), ("first", 4)]
    assert not output.scheduled[1].samples
    check_step(scheduler, output)


def test_budget_smaller_than_the_number_of_decodes_schedules_the_oldest_ones():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    seqs = [make_sequence(str(index), 2) for index in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    advance(scheduler.schedule())
    scheduler.max_num_batched_tokens = 3
    output = scheduler.schedule()
    assert shares(output) == {"0": 1, "1": 1, "2": 1}


def test_max_num_seqs_caps_admission_and_waiting_ones_follow_in_arrival_order():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_sequence(name, 4) for name in "abcde"]
    for seq in seqs:
        scheduler.add(seq)
    output = scheduler.schedule()
    assert shares(output) == {"a": 4, "b": 4}
    assert [seq.request_id for seq in scheduler.waiting] == ["c", "d", "e"]
    advance(output)
    scheduler.finish(seqs[1], SequenceStatus.FINISHED_STOPPED)
    output = scheduler.schedule()
    assert shares(output) == {"a": 1, "c": 4}
    advance(output)
    scheduler.finish(seqs[0], SequenceStatus.FINISHED_LENGTH)
    scheduler.finish(seqs[2], SequenceStatus.FINISHED_STOPPED)
    output = scheduler.schedule()
    assert shares(output) == {"d": 4, "e": 4}


def test_admission_is_first_come_first_served_even_when_a_later_prompt_would_fit():
    scheduler = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=100)
    holder = make_sequence("holder", 8)  # takes two of the four blocks
    scheduler.add(holder)
    advance(scheduler.schedule())
    big, small = make_sequence("big", 13), make_sequence("small", 2)
    scheduler.add(big)
    scheduler.add(small)
    output = scheduler.schedule()
    assert shares(output) == {"holder": 1}, "the small prompt must not overtake the big one"
    assert [seq.request_id for seq in scheduler.waiting] == ["big", "small"]
    advance(output)
    scheduler.finish(holder, SequenceStatus.FINISHED_STOPPED)
    output = scheduler.schedule()
    assert shares(output) == {"big": 13}  # "small" does not fit beside it (4 blocks in all)
    assert [seq.request_id for seq in scheduler.waiting] == ["small"]


def test_running_out_of_blocks_preempts_the_newest_running_sequence():
    manager = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = make_sequence("old", 8), make_sequence("new", 7)
    scheduler.add(old)
    scheduler.add(new)
    advance(scheduler.schedule())  # old: 2 blocks, new: 2 blocks, pool empty
    assert manager.num_free_blocks == 0
    later = make_sequence("later", 2)
    scheduler.add(later)
    output = scheduler.schedule()  # old needs a 3rd block for its 9th token -> new is preempted
    assert output.preempted == [new]
    assert shares(output) == {"old": 1}, "nothing is admitted in a step that preempted"
    assert new.status is SequenceStatus.WAITING
    assert new.block_table == [] and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert list(scheduler.waiting) == [new, later], "the victim goes back to the front of the queue"
    assert scheduler.running == [old]
    assert manager.num_used_blocks == 3
    assert scheduler.num_preemptions == 1
    check_step(scheduler, output)
    advance(output)
    scheduler.finish(old, SequenceStatus.FINISHED_STOPPED)
    output = scheduler.schedule()
    # The victim recomputes its prompt and the token it had generated, then samples again.
    assert shares(output) == {"new": 8, "later": 2}
    assert output.scheduled[0].samples
    check_step(scheduler, output)


def test_an_older_decode_that_needs_a_block_takes_it_from_the_newest():
    manager = BlockManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    first, second = make_sequence("first", 4), make_sequence("second", 8)
    scheduler.add(first)
    scheduler.add(second)
    advance(scheduler.schedule())
    output = scheduler.schedule()
    # first needs a second block for its 5th token; the newest running (second) gives its blocks back.
    assert output.preempted == [second]
    assert shares(output) == {"first": 1}
    assert manager.num_used_blocks == 2


def test_the_newest_sequence_preempts_itself_when_it_needs_a_block():
    manager = BlockManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    first, second = make_sequence("first", 7), make_sequence("second", 4)
    scheduler.add(first)
    scheduler.add(second)
    advance(scheduler.schedule())
    output = scheduler.schedule()
    # first's 8th token fits its 2 blocks; second (newest) needs a block and none is free.
    assert output.preempted == [second]
    assert shares(output) == {"first": 1}
    assert list(scheduler.waiting) == [second]
    assert manager.num_used_blocks == 2


def test_preempting_an_already_scheduled_sequence_removes_it_from_the_step():
    manager = BlockManager(num_blocks=5, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    prefill, decode = make_sequence("prefill", 4), make_sequence("decode", 7)
    scheduler.add(prefill)
    scheduler.add(decode)
    advance(scheduler.schedule())  # prefill: 1 block + 1 token pending; decode: 2 blocks
    prefill.token_ids += [NEXT_TOKEN] * 8  # 13 tokens, 4 computed: 9 to go, needs 4 blocks in all
    output = scheduler.schedule()
    # decode (newest) is scheduled first, then the prefill needs 3 more blocks: only 2 are free,
    # so decode is preempted and taken out of this step.
    assert output.preempted == [decode]
    assert shares(output) == {"prefill": 9}
    check_step(scheduler, output)


@settings(max_examples=40, deadline=None)
@given(
    prompt_lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    output_lengths=st.lists(st.integers(1, 12), min_size=8, max_size=8),
    arrival_steps=st.lists(st.integers(0, 6), min_size=8, max_size=8),
    abort_steps=st.lists(st.one_of(st.none(), st.integers(0, 20)), min_size=8, max_size=8),
    num_blocks=st.integers(14, 30),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
)
def test_random_workloads_respect_the_limits_and_end_with_the_pool_full(
        prompt_lengths, output_lengths, arrival_steps, abort_steps, num_blocks, budget, max_num_seqs):
    manager = BlockManager(num_blocks, block_size=4)  # 14 blocks hold the longest sequence (52 tokens)
    scheduler = Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    seqs = [make_sequence(str(index), length) for index, length in enumerate(prompt_lengths)]
    step = 0
    while step < 2000:
        for index, seq in enumerate(seqs):
            if arrival_steps[index] == step:
                scheduler.add(seq)
            if abort_steps[index] == step and not seq.is_finished and arrival_steps[index] <= step:
                scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        if step > max(arrival_steps) and not scheduler.has_unfinished():
            break
        output = scheduler.schedule()
        check_step(scheduler, output)
        if scheduler.has_unfinished():
            assert not output.is_empty, "no progress although sequences are unfinished"
        for seq in advance(output):
            if seq.num_output_tokens >= output_lengths[int(seq.request_id)]:
                scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
        step += 1
    assert not scheduler.has_unfinished(), "the workload did not finish"
    for index, seq in enumerate(seqs):
        if seq.status is SequenceStatus.FINISHED_LENGTH:
            assert seq.num_output_tokens == output_lengths[index]
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.ref_counts == [0] * num_blocks
