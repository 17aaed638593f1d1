"""Scheduling policy: priority (lower value first) for admission and preemption, and the step limits.

Scheduler tests drive sequences by hand as the engine does; engine tests
check on the tiny model that priority reaches the scheduler through
add_request and that the limits hold while outputs stay those of a run alone.
"""

from __future__ import annotations

import random

import pytest

from octavo.runtime.block_manager import BlockManager
from octavo.runtime.outputs import RequestOutput
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import Scheduler, SchedulerOutput
from octavo.runtime.sequence import Sequence, SequenceStatus
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import greedy, make_engine, random_tokens

pytestmark = pytest.mark.usefixtures("one_thread")

NEXT_TOKEN = 7


def make_sequence(name: str, prompt_length: int, priority: int) -> Sequence:
    return Sequence(name, 0, list(range(100, 100 + prompt_length)), SamplingParams(), detokenizer=None,
                    priority=priority)


def advance(output: SchedulerOutput) -> None:
    """Apply a step as the engine does: computed counts advance, sequences that reached their end sample."""
    sampled = [item.seq for item in output.scheduled if item.samples]
    for item in output.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
    for seq in sampled:
        seq.append_token(NEXT_TOKEN)


def names(output: SchedulerOutput) -> list[str]:
    return [item.seq.request_id for item in output.scheduled]


def test_lower_priority_value_is_admitted_first_then_arrival_order():
    scheduler = Scheduler(BlockManager(32, 4), max_num_seqs=1, max_num_batched_tokens=64)
    for name, priority in [("late-2", 2), ("first-0", 0), ("mid-1", 1), ("second-0", 0)]:
        scheduler.add(make_sequence(name, 3, priority))
    admitted = []
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        advance(output)
        for item in output.scheduled:
            admitted.append(item.seq.request_id)
            scheduler.finish(item.seq, SequenceStatus.FINISHED_STOPPED)
    assert admitted == ["first-0", "second-0", "mid-1", "late-2"]


def test_preemption_victim_is_the_lowest_priority_even_when_older():
    manager = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    unimportant = make_sequence("unimportant", 7, priority=5)
    important = make_sequence("important", 7, priority=0)
    scheduler.add(unimportant)
    advance(scheduler.schedule())
    scheduler.add(important)
    advance(scheduler.schedule())  # unimportant decodes, important is admitted: 2 + 2 blocks, pool full
    assert manager.num_free_blocks == 0
    output = scheduler.schedule()  # unimportant needs a 3rd block (for its 9th token), important does not
    assert output.preempted == [unimportant], "the older but less important sequence is preempted"
    assert names(output) == ["important"]
    assert unimportant.status is SequenceStatus.WAITING


def test_among_equal_priorities_the_newest_is_preempted():
    manager = BlockManager(num_blocks=6, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    sequences = [make_sequence(name, 8, priority) for name, priority in [("a", 1), ("b", 1), ("c", 0)]]
    for seq in sequences:
        scheduler.add(seq)
    advance(scheduler.schedule())  # c (priority 0) first, then a, then b: 6 blocks
    output = scheduler.schedule()
    assert output.preempted == [sequences[1]], "b: priority 1 and newer than a"
    assert names(output) == ["c", "a"]


# ---- on the tiny model ----

def alone(artifact, prompt: list[int], max_tokens: int) -> list[int]:
    engine = make_engine(artifact)
    engine.add_request(prompt, greedy(max_tokens), request_id="alone")
    finals = []
    while engine.has_unfinished_requests():
        finals += [output for output in engine.step() if output.finished]
    assert_pool_full(engine)
    return finals[0].outputs[0].token_ids


def test_engine_admits_by_priority(artifact):
    rng = random.Random(2)
    engine = make_engine(artifact, max_num_seqs=1)
    for name, priority in [("background", 3), ("normal", 1), ("urgent", 0)]:
        engine.add_request(random_tokens(rng, 6), greedy(2), request_id=name, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [output.request_id for output in engine.step() if output.finished]
    assert order == ["urgent", "normal", "background"]
    assert_pool_full(engine)


def test_decodes_are_never_starved_by_a_long_prefill_and_the_limits_hold(artifact):
    rng = random.Random(6)
    budget, max_num_seqs, max_model_len = 16, 3, 120
    short = [random_tokens(rng, 5), random_tokens(rng, 9)]
    long_prompt = random_tokens(rng, 100)
    engine = make_engine(artifact, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len)
    for index, prompt in enumerate(short):
        engine.add_request(prompt, greedy(30), request_id=f"short{index}")
    engine.step()  # both short prompts prefilled (14 tokens)
    engine.add_request(long_prompt, greedy(40), request_id="long")  # 100 + 40 > max_model_len
    engine.add_request(random_tokens(rng, 4), greedy(3), request_id="fourth")  # waits: max_num_seqs
    long_seq = engine.requests["long"].sequences[0]
    finals: dict[str, RequestOutput] = {}
    chunks = []
    while engine.has_unfinished_requests():
        decoding = [seq for seq in engine.scheduler.running if seq.num_uncomputed_tokens == 1]
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        schedule = engine.last_step.schedule
        assert schedule.num_batched_tokens <= budget and len(schedule.scheduled) <= max_num_seqs
        scheduled = {id(item.seq): item.num_new_tokens for item in schedule.scheduled}
        assert all(scheduled.get(id(seq)) == 1 for seq in decoding), "a decode was starved"
        if id(long_seq) in scheduled and scheduled[id(long_seq)] > 1:
            chunks.append(scheduled[id(long_seq)])
    assert chunks == [14, 14, 14, 14, 14, 14, 14, 2], "the long prompt is chunked under the budget"
    for index, prompt in enumerate(short):
        assert finals[f"short{index}"].outputs[0].token_ids == alone(artifact, prompt, 30)
    long_completion = finals["long"].outputs[0]
    assert len(long_prompt) + len(long_completion.token_ids) == max_model_len
    assert long_completion.finish_reason == "length"
    assert long_completion.token_ids == alone(artifact, long_prompt, 20)
    assert_pool_full(engine)
