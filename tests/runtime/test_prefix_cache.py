"""The prefix cache: LRU eviction, hits confirmed against tokens, statistics, metrics, and equivalence.

Model-free tests drive the BlockManager (and the Scheduler) by hand; engine
tests run the tiny compiled model and compare greedy outputs with prefix
caching on against the same requests with it off.
"""

from __future__ import annotations

import random

import pytest

from octavo.runtime.block_manager import BlockManager
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import Scheduler
from octavo.runtime.sequence import Sequence, SequenceStatus
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import (
    greedy,
    make_engine,
    observe_recompute_preemptions,
    random_tokens,
    run_to_completion,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 16  # the tiny artifact's block size


def make_sequence(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, 0, tokens, SamplingParams(), detokenizer=None)


def compute(manager: BlockManager, seq: Sequence) -> None:
    """Give `seq` blocks for all its tokens, mark them computed and cache its full blocks (as a step does)."""
    manager.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)


def hits_for(manager: BlockManager, seq: Sequence) -> list[int]:
    return manager.match_prefix(seq.token_ids, seq.block_hashes(manager))


# ---- LRU ----

def test_freed_cached_blocks_are_evicted_least_recently_freed_first_and_only_when_needed():
    manager = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    first, second = make_sequence("a", list(range(1, 9))), make_sequence("b", list(range(11, 19)))
    compute(manager, first)
    compute(manager, second)
    a0, a1 = first.block_table
    b0, b1 = second.block_table
    manager.free(first)   # a sequence gives back its last block first: it is the least useful prefix
    manager.free(second)
    assert list(manager.cached_free_blocks) == [a1, a0, b1, b0]
    assert manager.num_free_blocks == 6 and manager.num_cached_blocks == 4

    # Two never-used blocks are left: fresh allocations take them before evicting anything.
    for name in ("c", "d"):
        compute(manager, make_sequence(name, [50, 51, 52]))
    assert manager.stats.evictions == 0 and list(manager.cached_free_blocks) == [a1, a0, b1, b0]

    reuser = make_sequence("e", [*range(11, 19), 99])  # b's two blocks, then one more token
    hits = hits_for(manager, reuser)
    assert hits == [b0, b1]
    manager.take_prefix_hits(reuser, hits)
    assert list(manager.cached_free_blocks) == [a1, a0], "re-used blocks leave the evictable set"
    assert manager.blocks[b0].ref_count == 1 and manager.blocks[b1].ref_count == 1
    manager.allocate(reuser, reuser.num_tokens)  # its ninth token needs a fresh block: the LRU one goes
    assert reuser.block_table == [b0, b1, a1]
    assert manager.stats.evictions == 1 and list(manager.cached_free_blocks) == [a0]
    assert manager.blocks[a1].block_hash is None and a1 not in manager.hash_to_block.values()
    assert manager.blocks[a0].block_hash in manager.hash_to_block, "a0 is still cached"
    assert hits_for(manager, make_sequence("f", [*range(1, 9), 7])) == [a0], "a's first block still hits"


def test_a_fully_cached_prompt_recomputes_its_last_block():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    compute(manager, make_sequence("a", list(range(1, 13))))
    assert len(hits_for(manager, make_sequence("same", list(range(1, 13))))) == 2, "its last token needs logits"
    assert len(hits_for(manager, make_sequence("longer", list(range(1, 14))))) == 3
    assert hits_for(manager, make_sequence("other-start", [0, *range(2, 13)])) == []


# ---- entering blocks as they fill ----

class CountingBlocks(list):
    """The manager's block list, counting how often a block is looked at."""

    visits = 0

    def __getitem__(self, index):
        self.visits += 1
        return super().__getitem__(index)


def decode(manager: BlockManager, seq: Sequence, token: int) -> None:
    """One decode step of `seq`: a token appended, room for it, its K/V computed, full blocks entered."""
    seq.append_token(token)
    manager.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)


def block_visits_per_step(prompt_length: int) -> list[int]:
    """Blocks looked at by each of 12 decode steps (allocation included) after a prompt of that length."""
    manager = BlockManager(num_blocks=200, block_size=4, enable_prefix_caching=True)
    seq = make_sequence("a", list(range(1, prompt_length + 1)))
    compute(manager, seq)
    manager.blocks = counting = CountingBlocks(manager.blocks)
    visits = []
    for token in range(1000, 1012):
        before = counting.visits
        decode(manager, seq, token)
        visits.append(counting.visits - before)
    assert all(manager.blocks[block].block_hash is not None for block in seq.block_table[:seq.num_tokens // 4])
    return visits


def test_each_step_enters_only_the_blocks_that_just_filled():
    """A step's work on the prefix cache does not grow with the sequence: 7 or 70 full blocks before it."""
    assert block_visits_per_step(29) == block_visits_per_step(281)


def test_blocks_entered_after_a_cached_twin_chain_from_the_twin():
    """b computes the same first two blocks as a (twins, not entered); its third block follows a's entries."""
    manager = BlockManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    prefix = list(range(1, 9))
    first = make_sequence("a", [*prefix, 50])
    compute(manager, first)
    second = make_sequence("b", [*prefix, 60])  # admitted without a lookup: computes its own copies
    compute(manager, second)
    for token in (61, 62, 63):
        decode(manager, second, token)
    assert [manager.blocks[block].block_hash is not None for block in second.block_table] == [False, False, True]
    reader = make_sequence("c", [*prefix, 60, 61, 62, 63, 0])
    assert hits_for(manager, reader) == [*first.block_table[:2], second.block_table[2]]
    manager.free(second)  # the walk starts over on a new table
    manager.take_prefix_hits(second, hits_for(manager, reader))
    second.num_computed_tokens = 12
    manager.cache_full_blocks(second)
    assert second.cache_walk[0] == 3


# ---- hits are confirmed against the tokens ----

def hash_ignoring_first_token(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """A poor hash: blocks that differ only in their first token collide."""
    return hash((parent_hash, token_ids[1:]))


def test_a_block_whose_parent_collided_is_not_reused():
    """X and X' collide; Y after X is cached under the same hash chain as Y after X' would be."""
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True,
                           hash_function=hash_ignoring_first_token)
    x, x_prime, y = [1, 2, 3, 4], [9, 2, 3, 4], [5, 6, 7, 8]
    first = make_sequence("a", [*x_prime, 0])
    compute(manager, first)
    after_x = make_sequence("b", x + y + [0])
    assert hits_for(manager, after_x) == [], "X' must not be reused for X"
    assert hits_for(manager, after_x) == []
    assert manager.stats.hash_collisions == 0, "looking up changes nothing; admission counts"
    manager.take_prefix_hits(after_x, [])
    assert manager.stats.hash_collisions == 1
    compute(manager, after_x)
    # Y's K/V in after_x was computed after X: reusing it after X' would be wrong.
    assert hits_for(manager, make_sequence("c", x_prime + y + [0])) == [first.block_table[0]]


# ---- statistics: why a lookup missed ----

def test_statistics_explain_hits_misses_and_prefixes_shorter_than_a_block():
    manager = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    stats = manager.stats

    def admit(name: str, tokens: list[int]) -> Sequence:
        seq = make_sequence(name, tokens)
        scheduler.add(seq)
        output = scheduler.schedule()
        assert [item.seq for item in output.scheduled][-1] is seq
        for item in output.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            manager.cache_full_blocks(item.seq)
            if item.seq.num_computed_tokens == item.seq.num_tokens:
                scheduler.finish(item.seq, SequenceStatus.FINISHED_LENGTH)
        return seq

    base = list(range(100, 110))
    admit("first", base)  # 10 tokens: two reusable blocks (8 tokens), the last 2 can never hit
    assert (stats.lookups, stats.queried_tokens, stats.hit_tokens, stats.missed_tokens, stats.uncacheable_tokens,
            stats.lookups_missing_first_block) == (1, 10, 0, 8, 2, 1)
    admit("short", base[:3])  # shares 3 tokens, but a 3-token prompt has no full block to reuse
    assert (stats.hit_tokens, stats.missed_tokens, stats.uncacheable_tokens, stats.lookups_missing_first_block) == (
        0, 8, 2 + 3, 1)
    admit("diverges-in-block-0", base[:3] + [1] * 7)  # 10 tokens sharing only 3: the first block differs
    assert (stats.hit_tokens, stats.missed_tokens, stats.uncacheable_tokens, stats.lookups_missing_first_block) == (
        0, 16, 7, 2)
    shares_two_blocks = admit("shares-8", base[:8] + [2] * 4)  # 12 tokens: blocks 0-1 hit, the last block never can
    assert shares_two_blocks.num_cached_tokens == 8
    assert (stats.lookups, stats.queried_tokens, stats.hit_tokens, stats.missed_tokens, stats.uncacheable_tokens,
            stats.lookups_missing_first_block) == (4, 35, 8, 16, 11, 2)
    assert stats.queried_tokens == stats.hit_tokens + stats.missed_tokens + stats.uncacheable_tokens


# ---- on the tiny model ----

@pytest.fixture(scope="module")
def shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(21)
    system = random_tokens(rng, 40)
    block_multiple = random_tokens(rng, 32)
    short = random_tokens(rng, 10)
    return [system + random_tokens(rng, 5), system + random_tokens(rng, 12), list(system), block_multiple,
            list(block_multiple), short + random_tokens(rng, 4), short + random_tokens(rng, 20)]


def generate(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, greedy(10), request_id=f"{tag}{index}")
    finals = run_to_completion(engine)
    return [finals[f"{tag}{index}"].outputs[0].token_ids for index in range(len(prompts))]


@pytest.fixture(scope="module")
def uncached_outputs(artifact, shared_prefix_prompts) -> list[list[int]]:
    engine = make_engine(artifact, enable_prefix_caching=False)
    outputs = generate(engine, shared_prefix_prompts, "off")
    assert engine.block_manager.stats.lookups == 0 and engine.block_manager.num_cached_blocks == 0
    assert_pool_full(engine)
    return outputs


@pytest.mark.parametrize("budget", [1024, 24], ids=["whole-prompts", "chunked"])
def test_outputs_with_prefix_caching_equal_outputs_without(artifact, shared_prefix_prompts, uncached_outputs, budget):
    engine = make_engine(artifact, max_num_batched_tokens=budget)
    stats = engine.block_manager.stats
    # All at once: later prompts reuse blocks computed in the same or an earlier step.
    assert generate(engine, shared_prefix_prompts, "together") == uncached_outputs
    assert stats.hit_tokens > 0
    # Again, one at a time: every full block of every prompt is now cached (free, refcount 0).
    hits_before = stats.hit_tokens
    for index, prompt in enumerate(shared_prefix_prompts):
        engine.add_request(prompt, greedy(10), request_id=f"again{index}")
        output = run_to_completion(engine)[f"again{index}"]
        assert output.outputs[0].token_ids == uncached_outputs[index]
        expected_hit = (len(prompt) - 1) // BLOCK * BLOCK
        assert output.metrics.num_cached_tokens == expected_hit
    expected_total = sum((len(prompt) - 1) // BLOCK * BLOCK for prompt in shared_prefix_prompts)
    assert stats.hit_tokens - hits_before == expected_total
    assert_pool_full(engine)


@pytest.mark.parametrize("hash_name", ["ignores-first-token", "constant"])
def test_colliding_hashes_never_reuse_wrong_blocks(artifact, hash_name):
    rng = random.Random(4)
    x, y, tail = random_tokens(rng, BLOCK), random_tokens(rng, BLOCK), random_tokens(rng, 3)
    x_prime = [x[0] + 1, *x[1:]]
    prompts = [x_prime + tail, x + y + tail, x_prime + y + tail, x + y + tail, x + tail]
    reference = make_engine(artifact, enable_prefix_caching=False)
    expected = [generate(reference, [prompt], f"ref{index}")[0] for index, prompt in enumerate(prompts)]
    assert_pool_full(reference)
    engine = make_engine(artifact)
    engine.block_manager.hash_function = (hash_ignoring_first_token if hash_name == "ignores-first-token"
                                          else lambda parent_hash, token_ids: 0)
    for index, prompt in enumerate(prompts):  # one at a time, so each finds the previous ones cached
        assert generate(engine, [prompt], f"p{index}")[0] == expected[index], f"prompt {index} reused wrong K/V"
    assert engine.block_manager.stats.hash_collisions > 0
    assert engine.block_manager.stats.hit_tokens > 0, "the true hit (x_prime's block for prompt 2) still happens"
    assert_pool_full(engine)


def test_a_prefix_shorter_than_a_block_gets_no_hit_and_the_statistics_say_why(artifact):
    rng = random.Random(9)
    common = random_tokens(rng, 10)
    engine = make_engine(artifact)
    stats = engine.block_manager.stats
    generate(engine, [common + random_tokens(rng, 20)], "first")  # 30 tokens: block 0 is cached
    assert engine.block_manager.num_cached_blocks == 2  # 30 prompt + 9 computed output tokens = 2 full blocks
    before = (stats.lookups, stats.missed_tokens, stats.uncacheable_tokens, stats.lookups_missing_first_block)
    generate(engine, [common + random_tokens(rng, 4)], "short")  # 14 tokens: shorter than a block
    assert (stats.lookups, stats.missed_tokens, stats.uncacheable_tokens, stats.lookups_missing_first_block) == (
        before[0] + 1, before[1], before[2] + 14, before[3]), "all 14 tokens are uncacheable"
    generate(engine, [common + random_tokens(rng, 20)], "long")  # 30 tokens sharing 10: block 0 differs
    assert (stats.lookups, stats.missed_tokens, stats.uncacheable_tokens, stats.lookups_missing_first_block) == (
        before[0] + 2, before[1] + 16, before[2] + 14 + 14, before[3] + 1), "block 0 missed"
    assert stats.hit_tokens == 0
    metrics = engine.get_metrics()
    assert metrics.prefix_cache_hits_tokens == 0
    assert metrics.prefix_cache_queries_tokens == 30 + 14 + 30
    assert_pool_full(engine)


# ---- engine metrics ----

def test_get_metrics_reports_blocks_queues_preemptions_and_cache_counters(artifact):
    rng = random.Random(12)
    engine = make_engine(artifact, num_kv_blocks=4, max_num_seqs=1)
    first, second = random_tokens(rng, 20), random_tokens(rng, 5)
    engine.add_request(first, greedy(13), request_id="first")  # 33 tokens when done: 2 full blocks
    engine.add_request(second, greedy(4), request_id="second")
    engine.step()
    metrics = engine.get_metrics()
    running = engine.requests["first"].sequences[0]
    assert (metrics.num_running, metrics.num_waiting) == (1, 1)
    assert metrics.kv_blocks_total == 4
    assert metrics.kv_blocks_used == len(running.block_table) == 2
    assert metrics.kv_blocks_free == 2 and metrics.kv_blocks_cached == 0
    assert metrics.kv_usage == 0.5
    assert metrics.prefix_cache_queries_tokens == 20 and metrics.prefix_cache_hits_tokens == 0
    run_to_completion(engine)
    metrics = engine.get_metrics()
    # first: 32 computed tokens = 2 full blocks cached; second: 8 computed tokens, no full block.
    assert (metrics.num_running, metrics.num_waiting, metrics.kv_blocks_used) == (0, 0, 0)
    assert metrics.kv_blocks_cached == engine.block_manager.num_cached_blocks == 2
    assert metrics.kv_blocks_free == 4
    assert metrics.num_preemptions == 0
    assert_pool_full(engine)

    tight = make_engine(artifact, num_kv_blocks=3)
    for index in range(3):
        tight.add_request(random_tokens(rng, 15), greedy(12), request_id=str(index))
    last_computed: dict[str, int] = {}
    observed = 0
    while tight.has_unfinished_requests():
        tight.step()
        observed += observe_recompute_preemptions(tight, last_computed)
    assert tight.get_metrics().num_preemptions == observed > 0, "3 blocks cannot hold three 27-token sequences"
    assert_pool_full(tight)


def test_kv_utilization_is_tokens_stored_over_slots_allocated(artifact):
    rng = random.Random(13)
    engine = make_engine(artifact)
    assert engine.kv_utilization() == 1.0  # nothing allocated, nothing wasted
    engine.add_request(random_tokens(rng, 21), SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=8),
                       request_id="pair")
    engine.add_request(random_tokens(rng, 40), greedy(8), request_id="single")
    engine.step()
    # pair: 21 tokens in 2 blocks, shared by both samples (counted once); single: 40 tokens in 3 blocks.
    assert engine.kv_utilization() == pytest.approx((21 + 40) / ((2 + 3) * BLOCK))
    engine.step()
    # pair: block 0 shared (16), each sample's own last block holds 6 (tokens 16..21); single: 41 in 3 blocks.
    assert engine.kv_utilization() == pytest.approx((16 + 6 + 6 + 41) / ((3 + 3) * BLOCK))
    run_to_completion(engine)
    assert_pool_full(engine)
