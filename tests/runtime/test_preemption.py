"""Preemption (recompute and swap) and abort, on the scheduler and on a tiny compiled model.

A preempted greedy request must produce exactly the tokens it produces
with a pool large enough that nothing is preempted; an aborted request
gives back every block at once, whatever state it was in, and the other
requests are unaffected.
"""

from __future__ import annotations

import random

import pytest

from octavo.runtime.block_manager import BlockManager
from octavo.runtime.engine import LLMEngine
from octavo.runtime.host_pool import HostBlockPool
from octavo.runtime.outputs import RequestOutput
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import Scheduler, SchedulerOutput
from octavo.runtime.sequence import Sequence, SequenceStatus
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import greedy, make_engine, random_tokens, run_to_completion

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 16  # the tiny artifact's block size


# ---- scheduler level: a sequence preempted in the step that copied its shared block ----

def make_sequence(name: str, prompt: list[int], priority: int = 0) -> Sequence:
    return Sequence(name, 0, prompt, SamplingParams(), detokenizer=None, priority=priority)


def advance(output: SchedulerOutput, manager: BlockManager) -> None:
    for item in output.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        manager.cache_full_blocks(item.seq)


def copy_on_write_then_preempt(mode: str):
    """Three samples share a half-full block; an older, more important prefill then needs 3 blocks.

    Step 3: P and S1 copy the shared block (S2, its last holder, keeps it), then R's chunk finds
    one free block and preempts S2 (which frees the shared block) and S1, whose copy was queued
    this very step. Returns the manager, the scheduler, the samples, R and step 3's output.
    """
    manager = BlockManager(num_blocks=6, block_size=4)
    host_pool = HostBlockPool(8) if mode == "swap" else None
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=4, preemption_mode=mode,
                          host_pool=host_pool)
    first = make_sequence("P", [11, 12, 13, 14, 15, 16], priority=1)
    scheduler.add(first)
    advance(scheduler.schedule(), manager)  # P: 4 of 6 prompt tokens
    important = make_sequence("R", list(range(100, 116)), priority=0)
    scheduler.add(important)
    scheduler.max_num_batched_tokens = 6
    output = scheduler.schedule()
    assert [(item.seq.request_id, item.num_new_tokens) for item in output.scheduled] == [("P", 2), ("R", 4)]
    advance(output, manager)
    samples = [first]
    for index in (1, 2):  # as the engine forks parallel samples from sample 0 after its prompt
        sibling = first.fork(index, None)
        manager.fork(first, sibling)
        scheduler.add_running(sibling)
        samples.append(sibling)
    for token, seq in enumerate(samples):
        seq.append_token(20 + token)
    shared = first.block_table[1]
    assert manager.blocks[shared].ref_count == 3
    scheduler.max_num_batched_tokens = 64
    return manager, scheduler, samples, important, shared, scheduler.schedule()


def test_swapped_out_victim_takes_the_contents_of_the_block_it_was_copying():
    manager, _, (first, copier, last_holder), important, shared, output = copy_on_write_then_preempt("swap")
    assert output.preempted == [last_holder, copier]
    assert [item.seq for item in output.scheduled] == [first, important]
    copies = manager.take_pending_copies()
    assert [(copy.source, copy.destination) for copy in copies] == [(shared, first.block_table[1])], (
        "only the running sample's copy remains")
    swapped_from = {}
    for device_block, host_block in output.swap_out:
        swapped_from[host_block] = device_block
    for seq in (last_holder, copier):
        assert seq.status is SequenceStatus.SWAPPED
        # Its two blocks as they were before this step: the full prompt block and the shared half-full one.
        assert [swapped_from[host_block] for host_block in seq.host_block_table] == [first.block_table[0], shared]


def test_recompute_victim_leaves_no_copy_behind():
    manager, scheduler, (first, copier, last_holder), _, _, output = copy_on_write_then_preempt("recompute")
    assert output.preempted == [last_holder, copier]
    copies = manager.take_pending_copies()
    destinations = [copy.destination for copy in copies]
    assert destinations == [first.block_table[1]], "a preempted sequence's copy must not run"
    running_blocks = {block for seq in scheduler.running for block in seq.block_table}
    assert set(destinations) <= running_blocks
    for seq in (copier, last_holder):
        assert seq.status is SequenceStatus.WAITING and seq.block_table == []


# ---- on the tiny model ----

@pytest.fixture(scope="module")
def workload() -> list[tuple[list[int], SamplingParams]]:
    """Greedy prompts (some sharing a 40-token prefix) and a seeded n=3 sampling request."""
    rng = random.Random(7)
    shared = random_tokens(rng, 40)
    requests = [(random_tokens(rng, length), greedy(tokens)) for length, tokens in [(30, 20), (9, 24), (50, 12)]]
    requests += [(shared + random_tokens(rng, 5), greedy(16)), (shared + random_tokens(rng, 12), greedy(18))]
    requests.append((random_tokens(rng, 21), SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=14,
                                                            ignore_eos=True)))
    return requests


def run_workload(engine: LLMEngine, workload) -> dict[str, list[list[int]]]:
    for index, (prompt, params) in enumerate(workload):
        engine.add_request(prompt, params, request_id=str(index))
    finals = run_to_completion(engine)
    assert_pool_full(engine)
    return {request_id: [completion.token_ids for completion in output.outputs]
            for request_id, output in finals.items()}


@pytest.fixture(scope="module")
def large_pool_outputs(artifact, workload):
    engine = make_engine(artifact, num_kv_blocks=128)
    outputs = run_workload(engine, workload)
    assert engine.scheduler.num_preemptions == 0
    return outputs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_under_a_tiny_pool_equal_those_of_a_large_pool(artifact, workload, large_pool_outputs, mode):
    # 6 blocks = 96 token slots: the longest sequence (62 tokens) fits, the workload (about 330) does not.
    engine = make_engine(artifact, num_kv_blocks=6, max_num_batched_tokens=32, preemption_mode=mode,
                         swap_space="256KiB")
    if mode == "swap":
        assert engine.scheduler.host_pool.num_blocks == 32
    assert run_workload(engine, workload) == large_pool_outputs
    assert engine.scheduler.preemptions[mode] > 0, f"the tiny pool was meant to force {mode} preemption"
    if mode == "swap":
        assert engine.scheduler.preemptions["recompute"] == 0, "the host pool was large enough for every swap"
        assert engine.scheduler.host_pool.num_free_blocks == engine.scheduler.host_pool.num_blocks


def test_swap_mode_falls_back_to_recompute_when_the_host_pool_is_full(artifact, workload, large_pool_outputs):
    engine = make_engine(artifact, num_kv_blocks=6, max_num_batched_tokens=32, preemption_mode="swap",
                         swap_space="24KiB")  # 3 host blocks
    assert run_workload(engine, workload) == large_pool_outputs
    assert engine.scheduler.preemptions["swap"] > 0 and engine.scheduler.preemptions["recompute"] > 0
    assert engine.scheduler.host_pool.num_free_blocks == 3


# ---- abort at any time ----

def referenced_blocks(engine: LLMEngine) -> set[int]:
    return {block for seq in engine.scheduler.running for block in seq.block_table}


def check_abort(engine: LLMEngine, request_id: str) -> RequestOutput:
    """Abort, then check that the request's blocks (device and host) came back at once."""
    request = engine.requests[request_id]
    output = engine.abort_request(request_id)
    assert output.finished and all(completion.finish_reason == "abort" for completion in output.outputs)
    for seq in request.sequences:
        assert seq.status is SequenceStatus.FINISHED_ABORTED
        assert seq.block_table == [] and seq.host_block_table == []
    manager = engine.block_manager
    assert manager.num_used_blocks == len(referenced_blocks(engine)), "the aborted request still holds blocks"
    host_pool = engine.scheduler.host_pool
    if host_pool is not None:
        held = sum(len(seq.host_block_table) for seq in engine.scheduler.swapped)
        assert host_pool.num_free_blocks == host_pool.num_blocks - held
    return output


def finish_and_check_others(engine: LLMEngine, aborted: str, expected: dict[str, list[list[int]]]) -> None:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id != aborted, "an aborted request produced output"
            if output.finished:
                finals[output.request_id] = output
    for request_id, output in finals.items():
        assert [completion.token_ids for completion in output.outputs] == expected[request_id]
    assert_pool_full(engine)


def start(engine: LLMEngine, workload) -> None:
    for index, (prompt, params) in enumerate(workload):
        engine.add_request(prompt, params, request_id=str(index))


def step_until(engine: LLMEngine, condition, limit: int = 200) -> None:
    for _ in range(limit):
        if condition():
            return
        engine.step()
    raise AssertionError("the state to abort in was never reached")


def test_abort_while_waiting(artifact, workload, large_pool_outputs):
    engine = make_engine(artifact, max_num_seqs=2)
    start(engine, workload)
    engine.step()
    assert engine.requests["4"].sequences[0].status is SequenceStatus.WAITING
    output = check_abort(engine, "4")
    assert output.outputs[0].token_ids == []
    finish_and_check_others(engine, "4", large_pool_outputs)


def test_abort_mid_prefill_with_parallel_samples_not_forked_yet(artifact, workload, large_pool_outputs):
    engine = make_engine(artifact, max_num_batched_tokens=8)
    start(engine, workload)
    request = engine.requests["5"]  # n=3
    first = request.sequences[0]
    step_until(engine, lambda: first.status is SequenceStatus.RUNNING and first.num_computed_tokens > 0)
    assert first.num_computed_tokens < first.num_prompt_tokens and request.pending_forks == 2
    assert first.block_table
    output = check_abort(engine, "5")
    assert [completion.index for completion in output.outputs] == [0], "no sample is forked after an abort"
    finish_and_check_others(engine, "5", large_pool_outputs)


def test_abort_while_decoding_with_forked_samples(artifact, workload, large_pool_outputs):
    engine = make_engine(artifact)
    start(engine, workload)
    request = engine.requests["5"]
    step_until(engine, lambda: len(request.sequences) == 3 and request.sequences[0].num_output_tokens >= 3)
    shared = request.sequences[0].block_table[0]
    assert engine.block_manager.blocks[shared].ref_count == 3
    output = check_abort(engine, "5")
    assert [len(completion.token_ids) for completion in output.outputs] == [3, 3, 3]
    assert engine.block_manager.blocks[shared].ref_count == 0
    finish_and_check_others(engine, "5", large_pool_outputs)


def test_abort_while_swapped_out(artifact, workload, large_pool_outputs):
    engine = make_engine(artifact, num_kv_blocks=6, max_num_batched_tokens=32, preemption_mode="swap",
                         swap_space="256KiB")
    start(engine, workload)
    step_until(engine, lambda: bool(engine.scheduler.swapped))
    victim = engine.scheduler.swapped[0]
    assert victim.host_block_table
    check_abort(engine, victim.request_id)
    finish_and_check_others(engine, victim.request_id, large_pool_outputs)
    assert engine.scheduler.host_pool.num_free_blocks == engine.scheduler.host_pool.num_blocks
