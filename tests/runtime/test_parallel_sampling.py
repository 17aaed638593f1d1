"""Parallel samples (n > 1) on a tiny compiled model: equal to separate seeded requests, sharing blocks.

The engine's documented rule: sample i of a request with seed s draws from
a generator seeded s + i, so it equals a single request with seed s + i.
Sample 0 computes the prompt; the others are forked from it when its first
token is sampled and share its blocks, the half-filled last one until each
writes into it (copy-on-write).
"""

from __future__ import annotations

import random

import pytest

from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import make_engine, run_to_completion

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 2024


def sampling(n: int, seed: int, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, top_k=200, seed=seed, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(5)
    return [rng.randrange(3, 49000) for _ in range(21)]  # one full block and a half-filled one


@pytest.fixture(scope="module")
def separate_outputs(artifact, prompt) -> list[tuple[list[int], str]]:
    """Four single requests with seeds SEED..SEED+3, run together."""
    engine = make_engine(artifact)
    for index in range(4):
        engine.add_request(prompt, sampling(1, SEED + index), request_id=str(index))
    finals = run_to_completion(engine)
    assert_pool_full(engine)
    return [(finals[str(index)].outputs[0].token_ids, finals[str(index)].outputs[0].text) for index in range(4)]


def test_n4_equals_four_separately_seeded_requests_and_shares_the_prompt_blocks(artifact, prompt, separate_outputs):
    engine = make_engine(artifact)
    manager = engine.block_manager
    request = engine.add_request(prompt, sampling(4, SEED), request_id="n4")
    engine.step()  # the prompt step: sample 0 samples its first token, three siblings are forked from it
    samples = request.sequences
    assert [seq.index for seq in samples] == [0, 1, 2, 3]
    full_block, half_block = samples[0].block_table
    assert all(seq.block_table == [full_block, half_block] for seq in samples)
    assert manager.blocks[full_block].ref_count == 4 and manager.blocks[half_block].ref_count == 4
    assert manager.num_used_blocks == 2

    engine.step()  # each sample writes its 22nd token into the half-filled block: three copy it
    tables = [seq.block_table for seq in samples]
    assert all(table[0] == full_block for table in tables), "the full prompt block stays shared"
    last_blocks = [table[1] for table in tables]
    assert len(set(last_blocks)) == 4, "every sample writes into a block of its own"
    assert half_block in last_blocks, "the last sample to write keeps the original block"
    assert manager.blocks[full_block].ref_count == 4
    assert all(manager.blocks[block].ref_count == 1 for block in last_blocks)
    assert manager.num_used_blocks == 5, "1 shared + 4 private blocks, not 4 x 2"

    output = run_to_completion(engine)["n4"]
    assert [completion.index for completion in output.outputs] == [0, 1, 2, 3]
    assert [(completion.token_ids, completion.text) for completion in output.outputs] == separate_outputs
    assert len({tuple(completion.token_ids) for completion in output.outputs}) == 4, "the samples must differ"
    assert_pool_full(engine)


def test_prompt_ending_on_a_block_boundary_needs_no_copy(artifact):
    rng = random.Random(8)
    prompt = [rng.randrange(3, 49000) for _ in range(32)]
    engine = make_engine(artifact)
    request = engine.add_request(prompt, sampling(3, SEED, max_tokens=4), request_id="n3")
    engine.step()
    engine.step()
    samples = request.sequences
    assert all(seq.block_table[:2] == samples[0].block_table[:2] for seq in samples)
    assert len({seq.block_table[2] for seq in samples}) == 3
    assert engine.block_manager.num_used_blocks == 2 + 3
    output = run_to_completion(engine)["n3"]
    for index, completion in enumerate(output.outputs):
        single = make_engine(artifact)
        single.add_request(prompt, sampling(1, SEED + index, max_tokens=4), request_id="one")
        assert run_to_completion(single)["one"].outputs[0].token_ids == completion.token_ids
        assert_pool_full(single)
    assert_pool_full(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_n4_under_a_pool_that_forces_preemption_still_equals_the_separate_requests(
        artifact, prompt, separate_outputs, mode):
    # 3 blocks = 48 slots: one sample (33 tokens) fits, four samples (5+ blocks) do not.
    engine = make_engine(artifact, num_kv_blocks=3, preemption_mode=mode, swap_space="256KiB")
    engine.add_request(prompt, sampling(4, SEED), request_id="n4")
    output = run_to_completion(engine)["n4"]
    assert [(completion.token_ids, completion.text) for completion in output.outputs] == separate_outputs
    assert engine.scheduler.preemptions[mode] > 0
    assert_pool_full(engine)


def test_max_num_seqs_caps_the_samples_run_per_step(artifact, prompt, separate_outputs):
    engine = make_engine(artifact, max_num_seqs=2)
    engine.add_request(prompt, sampling(4, SEED), request_id="n4")
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        assert len(engine.last_step.schedule.scheduled) <= 2
    assert [(completion.token_ids, completion.text) for completion in finals["n4"].outputs] == separate_outputs
    assert_pool_full(engine)
