"""Block manager + scheduler together, model-free, under random workloads (hypothesis).

The test drives `Scheduler.schedule()` and then does what the engine does
with a step: swap-outs, copy-on-write copies and swap-ins move block
contents; the step writes every scheduled token's K/V; computed counts
advance and full blocks enter the prefix cache; sampled sequences get a
token, parallel samples are forked from sample 0 after its prompt, beams
are forked from their parent and the parent is freed. Requests arrive at
random steps with prompts that share prefixes, and are aborted at random.

The KV pool is simulated: the "K/V" written at position p of a sequence is
the tuple of its tokens 0..p, which is exactly what a real K/V depends on.
So a step that reads a slot holding anything else (a wrong prefix-cache
hit, a missed copy-on-write, a lost swap) is caught by comparing tuples.
After every step the block accounting is checked against its definition.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from octavo.runtime.block_manager import BlockManager, default_block_hash
from octavo.runtime.host_pool import HostBlockPool
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import Scheduler, SchedulerOutput
from octavo.runtime.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4
SHARED_PREFIXES = [tuple(range(1000, 1013)), tuple(range(2000, 2009))]
BLOCK_PIECES = [(1, 2, 3, 4), (9, 2, 3, 4)]  # they differ only in their first token
MAX_PROMPT = 16
MAX_OUTPUT = 8
BEAM_WIDTH = 3
SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]


def hash_ignoring_first_token(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Collides for blocks that differ only in their first token (a real hash may collide anywhere)."""
    return hash((parent_hash, token_ids[1:]))


def constant_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return 0


HASH_FUNCTIONS = {"default": default_block_hash, "ignores-first-token": hash_ignoring_first_token,
                  "constant": constant_hash}


# ---- invariants, from the definitions ----

def check_block_manager(manager: BlockManager, sequences: list[Sequence]) -> None:
    """Refcounts = block-table references; free lists exact and disjoint; the cache consistent."""
    references = [0] * manager.num_blocks
    for seq in sequences:
        for block_id in seq.block_table:
            references[block_id] += 1
    assert manager.ref_counts == references, "a refcount differs from the number of block-table references"
    free = list(manager.free_block_ids)
    cached_free = list(manager.cached_free_blocks)
    assert len(free) == len(set(free)), "a block is in the free list twice"
    assert not set(free) & set(cached_free), "a block is both plain-free and cached-free"
    unreferenced = {block for block in range(manager.num_blocks) if references[block] == 0}
    assert set(free) | set(cached_free) == unreferenced, "free lists differ from the unreferenced blocks"
    assert manager.num_free_blocks + manager.num_used_blocks == manager.num_blocks
    for block_id in cached_free:
        assert manager.blocks[block_id].block_hash is not None, "an uncached block in the cached-free list"
    for block in manager.blocks:
        if block.block_hash is None:
            assert block.token_ids is None and block.parent_hash is None
            continue
        assert manager.hash_to_block.get(block.block_hash) == block.block_id, "hash_to_block does not point back"
        assert len(block.token_ids) == manager.block_size
        assert manager.hash_function(block.parent_hash, block.token_ids) == block.block_hash, (
            "a cached block's tokens do not match its hash chain")
    for block_hash, block_id in manager.hash_to_block.items():
        assert manager.blocks[block_id].block_hash == block_hash


def check_host_pool(host_pool: HostBlockPool | None, swapped: list[Sequence], others: list[Sequence]) -> None:
    if host_pool is None:
        assert all(not seq.host_block_table for seq in swapped + others)
        return
    free = list(host_pool.free_block_ids)
    held = [block for seq in swapped for block in seq.host_block_table]
    assert len(free) == len(set(free)), "a host block is free twice"
    assert len(held) == len(set(held)), "a host block is held twice"
    assert not set(free) & set(held), "a held host block is also free"
    assert len(free) + len(held) == host_pool.num_blocks, "host blocks leaked"
    assert all(not seq.host_block_table for seq in others), "a sequence that is not swapped holds host blocks"


# ---- the simulated engine ----

@dataclass(eq=False)
class Group:
    """One request: a single sequence, n parallel samples, or beams."""

    kind: str  # "single" | "parallel" | "beam"
    prompt: list[int]
    output_length: int
    n: int = 1
    priority: int = 0
    sequences: list[Sequence] = field(default_factory=list)
    forked: bool = False

    @property
    def live(self) -> list[Sequence]:
        return [seq for seq in self.sequences if not seq.is_finished]


class SimulatedEngine:
    def __init__(self, data, mode: str, caching: bool, hash_name: str, num_blocks: int, num_host_blocks: int,
                 max_num_seqs: int, budget: int):
        self.data = data
        self.manager = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=caching,
                                    hash_function=HASH_FUNCTIONS[hash_name])
        self.host_pool = HostBlockPool(num_host_blocks) if mode == "swap" else None
        self.scheduler = Scheduler(self.manager, max_num_seqs, budget, mode, self.host_pool)
        self.device_kv = [[None] * BLOCK_SIZE for _ in range(num_blocks)]
        self.host_kv = [[None] * BLOCK_SIZE for _ in range(num_host_blocks)]
        self.groups: list[Group] = []
        self.token_counter = itertools.count(5000)
        self.steps = 0

    # -- requests --

    def add(self, group: Group) -> None:
        seq = Sequence(f"r{len(self.groups)}", 0, list(group.prompt), SamplingParams(), detokenizer=None,
                       priority=group.priority)
        group.sequences.append(seq)
        self.groups.append(group)
        self.scheduler.add(seq)

    def abort(self, group: Group) -> None:
        for seq in group.live:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            assert seq.block_table == [] and seq.host_block_table == []

    def all_sequences(self) -> list[Sequence]:
        return [seq for group in self.groups for seq in group.live]

    # -- one step --

    def step(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        self.check_schedule(output)
        self.move_blocks(output)
        self.run(output)
        for item in output.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.manager.cache_full_blocks(item.seq)
        self.sample([item.seq for item in output.scheduled if item.seq.num_computed_tokens == item.seq.num_tokens])
        self.steps += 1
        self.check_state()
        return output

    def move_blocks(self, output: SchedulerOutput) -> None:
        """The engine's order: swap-outs read first, then copy-on-write, then swap-ins."""
        for device_block, host_block in output.swap_out:
            self.host_kv[host_block] = list(self.device_kv[device_block])
        copies = self.manager.take_pending_copies()
        destinations = [copy.destination for copy in copies]
        assert len(destinations) == len(set(destinations)), "two copies write the same block in one step"
        sources = [list(self.device_kv[copy.source]) for copy in copies]
        for copy, contents in zip(copies, sources, strict=True):
            self.device_kv[copy.destination] = contents
        for host_block, device_block in output.swap_in:
            self.device_kv[device_block] = list(self.host_kv[host_block])

    def run(self, output: SchedulerOutput) -> None:
        """Write every scheduled token's K/V, then check every slot each sequence attends to."""
        for item in output.scheduled:
            seq = item.seq
            for position in range(seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens):
                self.slot(seq, position)[position % BLOCK_SIZE] = tuple(seq.token_ids[:position + 1])
        for item in output.scheduled:
            seq = item.seq
            for position in range(seq.num_computed_tokens + item.num_new_tokens):
                found = self.slot(seq, position)[position % BLOCK_SIZE]
                assert found == tuple(seq.token_ids[:position + 1]), (
                    f"{seq.seq_id} reads wrong K/V at position {position}")

    def slot(self, seq: Sequence, position: int) -> list:
        return self.device_kv[seq.block_table[position // BLOCK_SIZE]]

    def sample(self, sampled: list[Sequence]) -> None:
        for seq in sampled:
            group = next(group for group in self.groups if seq in group.sequences)
            if group.kind == "beam":
                self.fork_beams(group, seq)
                continue
            samples = [seq]
            if group.kind == "parallel" and not group.forked:
                samples += self.fork_parallel_samples(group, seq)
            for sample in samples:
                self.append(group, sample)

    def fork_parallel_samples(self, group: Group, first: Sequence) -> list[Sequence]:
        """As LLMEngine does: siblings share sample 0's blocks once its prompt is computed."""
        group.forked = True
        siblings = []
        for index in range(1, group.n):
            sibling = first.fork(index, None)
            self.manager.fork(first, sibling)
            self.scheduler.add_running(sibling)
            siblings.append(sibling)
        group.sequences += siblings
        return siblings

    def fork_beams(self, group: Group, parent: Sequence) -> None:
        """As beam search does: children are forks of the parent with one more token; the parent is freed."""
        if parent.num_output_tokens >= group.output_length:
            self.scheduler.finish(parent, SequenceStatus.FINISHED_LENGTH)
            return
        room = BEAM_WIDTH - len(group.live) + 1
        for _ in range(min(room, self.data.draw(st.sampled_from([1, 2, 0]), label="children"))):
            child = parent.fork(len(group.sequences), None)
            self.manager.fork(parent, child)
            child.append_token(next(self.token_counter))
            self.scheduler.add_running(child)
            group.sequences.append(child)
        self.scheduler.finish(parent, SequenceStatus.FINISHED_STOPPED)

    def append(self, group: Group, seq: Sequence) -> None:
        if seq.is_finished:
            return
        # Half the time a token seen before, so later prompts and outputs share full blocks.
        token = self.data.draw(st.sampled_from([7, 8, next(self.token_counter)]), label="token")
        seq.append_token(token)
        if seq.num_output_tokens >= group.output_length:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)

    # -- checks --

    def check_schedule(self, output: SchedulerOutput) -> None:
        scheduler = self.scheduler
        assert output.num_batched_tokens <= scheduler.max_num_batched_tokens
        assert len(output.scheduled) <= scheduler.max_num_seqs
        if scheduler.has_unfinished():
            assert not output.is_empty, "no progress although sequences are unfinished"
        for item in output.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING and item.num_new_tokens >= 1
            assert seq.num_computed_tokens + item.num_new_tokens <= seq.num_tokens
            assert len(seq.block_table) >= self.manager.blocks_for_tokens(seq.num_computed_tokens + item.num_new_tokens)
        decodes = [item for item in output.scheduled if item.seq.num_uncomputed_tokens == 1]
        running_decodes = [seq for seq in scheduler.running if seq.num_uncomputed_tokens == 1]
        if len(decodes) < len(running_decodes):
            assert (output.num_batched_tokens == scheduler.max_num_batched_tokens
                    or len(output.scheduled) == scheduler.max_num_seqs), "a decode was left out although room remained"

    def check_state(self) -> None:
        scheduler = self.scheduler
        live = self.all_sequences()
        assert {id(seq) for seq in live} == {id(seq) for seq in scheduler.running + scheduler.waiting
                                             + scheduler.swapped}, "a live sequence is not queued exactly once"
        assert len(scheduler.running + scheduler.waiting + scheduler.swapped) == len(live)
        check_block_manager(self.manager, live)
        check_host_pool(self.host_pool, scheduler.swapped, scheduler.running + scheduler.waiting)
        for seq in scheduler.running:
            assert len(seq.block_table) >= self.manager.blocks_for_tokens(seq.num_computed_tokens)
        for seq in scheduler.waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        for seq in scheduler.swapped:
            assert seq.block_table == []
            assert len(seq.host_block_table) >= self.manager.blocks_for_tokens(seq.num_computed_tokens)
            for position in range(seq.num_computed_tokens):
                stored = self.host_kv[seq.host_block_table[position // BLOCK_SIZE]][position % BLOCK_SIZE]
                assert stored == tuple(seq.token_ids[:position + 1]), f"{seq.seq_id} lost K/V in the host pool"
        for block in self.manager.blocks:
            if block.block_hash is not None:
                last = self.device_kv[block.block_id][BLOCK_SIZE - 1]
                assert last is not None and last[-BLOCK_SIZE:] == block.token_ids, (
                    "a cached block does not hold the tokens it is cached under")
                assert chain_hash(self.manager, last) == block.block_hash, (
                    "a cached block's contents were computed under another prefix than its hash chain says")
                parent = next((other for other in self.manager.blocks
                               if block.parent_cache_id is not None and other.cache_id == block.parent_cache_id), None)
                if parent is not None:
                    assert self.device_kv[parent.block_id][BLOCK_SIZE - 1] == last[:-BLOCK_SIZE], (
                        "a cached block's recorded parent holds another prefix")


def chain_hash(manager: BlockManager, tokens: tuple[int, ...]) -> int | None:
    parent = None
    for start in range(0, len(tokens), BLOCK_SIZE):
        parent = manager.hash_function(parent, tuple(tokens[start:start + BLOCK_SIZE]))
    return parent


# ---- the workload ----

@st.composite
def prompts(draw, forms=("blocks", "shared-prefix")) -> list[int]:
    """Prompts that share prefixes: part of a shared prefix, or whole blocks from a few that differ
    only in their first token (so the colliding hash functions collide), then a tail."""
    if draw(st.sampled_from(forms)) == "blocks":
        pieces = draw(st.lists(st.sampled_from(BLOCK_PIECES), min_size=1, max_size=MAX_PROMPT // BLOCK_SIZE - 1))
        prefix = tuple(token for piece in pieces for token in piece)
        length = len(prefix) + draw(st.integers(0, BLOCK_SIZE))
    else:
        length = draw(st.integers(1, MAX_PROMPT))
        prefix = draw(st.sampled_from([(), *SHARED_PREFIXES]))[:draw(st.integers(0, length))]
    tail = draw(st.lists(st.sampled_from([7, 8, 9]), min_size=length - len(prefix), max_size=length - len(prefix)))
    return list(prefix) + tail


@st.composite
def groups(draw, kinds=("single", "single", "parallel", "beam"), forms=("blocks", "shared-prefix")) -> Group:
    kind = draw(st.sampled_from(kinds))
    return Group(kind, draw(prompts(forms)), draw(st.integers(1, MAX_OUTPUT)),
                 n=draw(st.integers(2, 4)) if kind == "parallel" else 1, priority=draw(st.integers(0, 2)))


def run_workload(data, engine: SimulatedEngine, max_groups: int, kinds=("single", "single", "parallel", "beam"),
                 forms=("blocks", "shared-prefix")) -> None:
    arrivals = 0
    while arrivals < max_groups or engine.scheduler.has_unfinished():
        assert engine.steps < 1000, "the workload did not finish"
        if arrivals < max_groups:
            idle = not engine.scheduler.has_unfinished()
            for _ in range(data.draw(st.integers(1 if idle else 0, 2), label="arrivals")):
                if arrivals < max_groups:
                    engine.add(data.draw(groups(kinds, forms), label="group"))
                    arrivals += 1
        live_groups = [group for group in engine.groups if group.live]
        if live_groups and data.draw(st.integers(0, 9), label="abort?") == 9:
            engine.abort(data.draw(st.sampled_from(live_groups), label="aborted"))
            engine.check_state()
        if engine.scheduler.has_unfinished():
            engine.step()
    manager = engine.manager
    assert manager.num_free_blocks == manager.num_blocks, "the pool is not complete again"
    assert manager.ref_counts == [0] * manager.num_blocks
    if engine.host_pool is not None:
        assert engine.host_pool.num_free_blocks == engine.host_pool.num_blocks, "host blocks leaked"
    assert all(seq.is_finished for group in engine.groups for seq in group.sequences)
    for group in engine.groups:
        for seq in group.sequences:
            if seq.status is SequenceStatus.FINISHED_LENGTH:
                assert seq.num_output_tokens == group.output_length


# The longest sequence has MAX_PROMPT + MAX_OUTPUT tokens = 6 blocks; a pool of 6 to 12 blocks forces preemption.
@settings(max_examples=300, deadline=None, suppress_health_check=SLOW_DATA)
@given(data=st.data(), mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       hash_name=st.sampled_from(sorted(HASH_FUNCTIONS)), num_blocks=st.integers(6, 12),
       num_host_blocks=st.integers(1, 10), max_num_seqs=st.integers(1, 6), budget=st.integers(1, 24),
       max_groups=st.integers(2, 8))
def test_random_workloads_keep_every_invariant_and_end_with_the_pool_complete(
        data, mode, caching, hash_name, num_blocks, num_host_blocks, max_num_seqs, budget, max_groups):
    engine = SimulatedEngine(data, mode, caching, hash_name, num_blocks, num_host_blocks, max_num_seqs, budget)
    run_workload(data, engine, max_groups)
    target(float(engine.scheduler.num_preemptions), label="preemptions")  # steer the search towards pressure


@settings(max_examples=400, deadline=None, suppress_health_check=SLOW_DATA)
@given(data=st.data(), mode=st.sampled_from(["recompute", "swap"]), budget=st.integers(1, 24))
def test_tiny_pool_with_parallel_samples_preempts_and_stays_consistent(data, mode, budget):
    """A pool that holds exactly one longest sequence, all requests n>1: preemption on almost every step."""
    engine = SimulatedEngine(data, mode, True, "default", 6, 6, 6, budget)
    run_workload(data, engine, 3, kinds=("parallel",))


@settings(max_examples=400, deadline=None, suppress_health_check=SLOW_DATA)
@given(data=st.data(), mode=st.sampled_from(["recompute", "swap"]),
       hash_name=st.sampled_from(["ignores-first-token", "constant"]), num_blocks=st.integers(8, 16),
       budget=st.integers(1, 24), max_groups=st.integers(3, 8))
def test_colliding_hash_functions_never_make_a_sequence_read_another_prefix(
        data, mode, hash_name, num_blocks, budget, max_groups):
    """Prompts built from blocks that collide under these hash functions: hits must be confirmed."""
    engine = SimulatedEngine(data, mode, True, hash_name, num_blocks, 8, 4, budget)
    run_workload(data, engine, max_groups, kinds=("single", "single", "parallel"), forms=("blocks",))
