"""The engine's KV memory under random workloads (hypothesis), driving the real LLMEngine.

A tiny random-weight llama (vocabulary 512, KV blocks of 4 tokens, so short
sequences span several blocks) is compiled once. Each example builds an
LLMEngine on it with a small pool and random limits (preemption by
recompute or swap, prefix caching on or off, block hash functions that
collide, token budget, max_num_seqs), submits requests at random steps
(prompts that share prefixes and whole blocks; greedy single requests and
n > 1 parallel samples; priorities), aborts some at random, and steps the
engine until it is idle. So the scheduler, the block manager and the
engine's own step run as they do when serving: LLMEngine._move_blocks
(swap-outs, copy-on-write copies and swap-ins on the real KV pool) and
LLMEngine._fork_siblings (parallel samples sharing sample 0's blocks). Beam
search, which forks beams and frees their parents, has its own test.

After every step the block accounting is checked against its definition
(reference counts = block-table references, exact free lists, a consistent
prefix cache, host blocks held exactly by swapped sequences). Every sampled
row's logits must equal Hugging Face's logits for the tokens its sequence
holds (fp32 eager, max abs difference LOGITS_TOLERANCE, as in
test_architectures): a step that attends to a slot holding anything else (a
wrong prefix-cache hit, a missed or misordered copy-on-write, a lost swap)
moves them by orders of magnitude more (with LLMEngine._move_blocks skipping
its copy-on-write copies, every test here fails, by logits 2.5 off).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from octavo.compiler import compile_model
from octavo.config import CompileConfig, EngineConfig
from octavo.runtime.beam_search import BeamSearchParams, beam_search
from octavo.runtime.block_manager import BlockManager, default_block_hash
from octavo.runtime.engine import LLMEngine
from octavo.runtime.host_pool import HostBlockPool
from octavo.runtime.kv_cache import bytes_per_block
from octavo.runtime.loader import load_artifact
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.sequence import Sequence
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_SIZE = 4
VOCAB_SIZE = 512
SHARED_PREFIXES = [tuple(range(100, 113)), tuple(range(200, 209))]
BLOCK_PIECES = [(11, 12, 13, 14), (19, 12, 13, 14)]  # they differ only in their first token
MAX_PROMPT = 16
MAX_OUTPUT = 8
LOGITS_TOLERANCE = 1e-4
SLOW_DATA = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
             HealthCheck.function_scoped_fixture]


def hash_ignoring_first_token(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Collides for blocks that differ only in their first token (a real hash may collide anywhere)."""
    return hash((parent_hash, token_ids[1:]))


def constant_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return 0


HASH_FUNCTIONS = {"default": default_block_hash, "ignores-first-token": hash_ignoring_first_token,
                  "constant": constant_hash}


class Model:
    """The compiled artifact and HF's model (a plain class: hypothesis prints it by this repr)."""

    def __init__(self, artifact, hf: torch.nn.Module):
        self.artifact, self.hf = artifact, hf

    def __repr__(self) -> str:
        return "Model(tiny llama, vocabulary 512, 4-token blocks)"


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir) -> Model:
    """The tiny llama with a 512-token vocabulary, compiled with 4-token KV blocks, and HF's own copy of it."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("tiny-llama-small-vocab")
    make_tiny_model("llama", vocab_size=VOCAB_SIZE).save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory / file.name)
    path = compile_model(directory, tmp_path_factory.mktemp("small-vocab-artifact") / "artifact",
                         CompileConfig(dtype="float32", block_size=BLOCK_SIZE))
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    return Model(load_artifact(path), hf)


def make_engine(model: Model, *, mode: str = "recompute", caching: bool = True, hash_name: str = "default",
                num_blocks: int = 8, num_host_blocks: int = 4, max_num_seqs: int = 4, budget: int = 16) -> LLMEngine:
    layout = model.artifact.kv_layout
    engine = LLMEngine(model.artifact, EngineConfig(
        num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        enable_prefix_caching=caching, preemption_mode=mode, swap_space=num_host_blocks * bytes_per_block(layout)))
    engine.block_manager.hash_function = HASH_FUNCTIONS[hash_name]
    return engine


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


def check_engine_state(engine: LLMEngine) -> None:
    scheduler, manager = engine.scheduler, engine.block_manager
    live = [seq for request in engine.requests.values() for seq in request.sequences if not seq.is_finished]
    queued = scheduler.running + scheduler.waiting + scheduler.swapped
    assert {id(seq) for seq in live} == {id(seq) for seq in queued}, "a live sequence is not queued exactly once"
    assert len(queued) == len(live)
    check_block_manager(manager, live)
    check_host_pool(scheduler.host_pool, scheduler.swapped, scheduler.running + scheduler.waiting)
    for seq in scheduler.running:
        assert len(seq.block_table) >= manager.blocks_for_tokens(seq.num_computed_tokens)
    for seq in scheduler.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    for seq in scheduler.swapped:
        assert seq.block_table == []
        assert len(seq.host_block_table) >= manager.blocks_for_tokens(seq.num_computed_tokens)


def assert_pool_complete(engine: LLMEngine) -> None:
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks, "the pool is not complete again"
    assert manager.ref_counts == [0] * manager.num_blocks
    host_pool = engine.scheduler.host_pool
    if host_pool is not None:
        assert host_pool.num_free_blocks == host_pool.num_blocks, "host blocks leaked"


def assert_rows_match_hf(hf: torch.nn.Module, rows: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
    """Each (context, logits row) against HF's logits at the context's last token.

    Contexts that are prefixes of a longer one share its forward: the longest
    contexts run as one batch, right-padded (causal attention never reads a
    later position, so padding changes no earlier row).
    """
    if not rows:  # every request was aborted before it was scheduled
        return
    longest: list[tuple[int, ...]] = []
    for context in sorted({context for context, _ in rows}, key=len, reverse=True):
        if not any(other[:len(context)] == context for other in longest):
            longest.append(context)
    batch = torch.zeros(len(longest), len(longest[0]), dtype=torch.int64)
    for index, context in enumerate(longest):
        batch[index, :len(context)] = torch.tensor(context)
    with torch.no_grad():
        expected = hf(batch).logits
    worst = 0.0
    for context, row in rows:
        index = next(index for index, other in enumerate(longest) if other[:len(context)] == context)
        worst = max(worst, (expected[index, len(context) - 1] - row).abs().max().item())
    assert worst <= LOGITS_TOLERANCE, f"a sampled row's logits differ from HF's by {worst}"


# ---- driving the engine ----

@dataclass
class Workload:
    """Submits, aborts and steps one engine; checks every step; keeps every sampled row's logits."""

    data: object
    engine: LLMEngine
    rows: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)
    expected: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (n, tokens per sample)
    aborted: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)

    def submit(self, prompt: list[int], n: int, max_tokens: int, priority: int) -> None:
        request_id = f"r{len(self.expected)}"
        params = (SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True) if n > 1
                  else SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        self.engine.add_request(prompt, params, request_id=request_id, priority=priority)
        self.expected[request_id] = (n, min(max_tokens, self.engine.max_model_len - len(prompt)))

    def abort(self, request_id: str) -> None:
        request = self.engine.requests[request_id]
        self.engine.abort_request(request_id)
        assert all(seq.block_table == [] and seq.host_block_table == [] for seq in request.sequences)
        self.aborted.add(request_id)
        check_engine_state(self.engine)

    def step(self) -> None:
        engine, scheduler = self.engine, self.engine.scheduler
        decodes_before = [seq for seq in scheduler.running if seq.num_uncomputed_tokens == 1]
        steps_before = engine.num_steps
        for output in engine.step():
            if output.finished:
                self.check_finished(output)
        assert engine.num_steps == steps_before + 1, "no progress although sequences are unfinished"
        record = engine.last_step
        self.check_schedule(record.schedule, decodes_before)
        for row, scheduled_index in enumerate(record.inputs.sampled_rows):
            seq = record.schedule.scheduled[scheduled_index].seq
            self.rows.append((tuple(seq.token_ids[:seq.num_computed_tokens]), record.logits[row].clone()))
        check_engine_state(engine)

    def check_schedule(self, schedule, decodes_before: list[Sequence]) -> None:
        scheduler = self.engine.scheduler
        assert 0 < schedule.num_batched_tokens <= scheduler.max_num_batched_tokens
        assert len(schedule.scheduled) <= scheduler.max_num_seqs
        assert all(item.num_new_tokens >= 1 for item in schedule.scheduled)
        scheduled = {id(item.seq) for item in schedule.scheduled}
        preempted = {id(seq) for seq in schedule.preempted}
        left_out = [seq for seq in decodes_before if id(seq) not in scheduled | preempted]
        if left_out:
            assert (schedule.num_batched_tokens == scheduler.max_num_batched_tokens
                    or len(schedule.scheduled) == scheduler.max_num_seqs), "a decode was left out with room left"

    def check_finished(self, output) -> None:
        self.finished.add(output.request_id)
        if output.request_id in self.aborted:
            return
        n, length = self.expected[output.request_id]
        assert len(output.outputs) == n
        for completion in output.outputs:
            assert (len(completion.token_ids), completion.finish_reason) == (length, "length"), output.request_id

    def run(self, max_requests: int, parallel_only: bool = False, forms=("blocks", "shared-prefix")) -> None:
        data, engine = self.data, self.engine
        submitted = 0
        while submitted < max_requests or engine.has_unfinished_requests():
            assert engine.num_steps < 500, "the workload did not finish"
            if submitted < max_requests:
                idle = not engine.has_unfinished_requests()
                for _ in range(data.draw(st.integers(1 if idle else 0, 2), label="arrivals")):
                    if submitted < max_requests:
                        n = data.draw(st.integers(2, 4) if parallel_only else st.sampled_from([1, 1, 2, 3, 4]),
                                      label="n")
                        self.submit(data.draw(prompts(forms), label="prompt"), n,
                                    data.draw(st.integers(1, MAX_OUTPUT), label="max_tokens"),
                                    data.draw(st.integers(0, 2), label="priority"))
                        submitted += 1
            if engine.requests and data.draw(st.integers(0, 9), label="abort?") == 9:
                self.abort(data.draw(st.sampled_from(sorted(engine.requests)), label="aborted"))
            if engine.has_unfinished_requests():
                self.step()
        assert set(self.expected) == self.finished | self.aborted
        assert_pool_complete(engine)


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


# The longest sequence has MAX_PROMPT + MAX_OUTPUT tokens = 6 blocks; a pool of 6 to 12 blocks forces preemption.
@settings(max_examples=60, deadline=None, suppress_health_check=SLOW_DATA)
@given(data=st.data(), mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       hash_name=st.sampled_from(sorted(HASH_FUNCTIONS)), num_blocks=st.integers(6, 12),
       num_host_blocks=st.integers(1, 10), max_num_seqs=st.integers(1, 6), budget=st.integers(1, 24),
       max_requests=st.integers(2, 8))
def test_random_workloads_keep_every_invariant_and_end_with_the_pool_complete(
        model, data, mode, caching, hash_name, num_blocks, num_host_blocks, max_num_seqs, budget, max_requests):
    engine = make_engine(model, mode=mode, caching=caching, hash_name=hash_name, num_blocks=num_blocks,
                         num_host_blocks=num_host_blocks, max_num_seqs=max_num_seqs, budget=budget)
    workload = Workload(data, engine)
    workload.run(max_requests)
    assert_rows_match_hf(model.hf, workload.rows)
    target(float(engine.scheduler.num_preemptions), label="preemptions")  # steer the search towards pressure


@settings(max_examples=100, deadline=None, suppress_health_check=SLOW_DATA)
@given(data=st.data(), mode=st.sampled_from(["swap", "swap", "recompute"]), budget=st.integers(1, 24))
def test_tiny_pool_with_parallel_samples_preempts_and_stays_consistent(model, data, mode, budget):
    """A pool that holds exactly one longest sequence, all requests n>1: preemption on almost every step.

    Swap mode is drawn twice as often and the search is steered towards swap preemptions: a swap-out
    in the step that also copies a shared block is where the order of the engine's block moves
    matters (running the copies before the swap-outs fails here within about 100 examples).
    """
    engine = make_engine(model, mode=mode, num_blocks=6, num_host_blocks=6, max_num_seqs=6, budget=budget)
    workload = Workload(data, engine)
    workload.run(3, parallel_only=True)
    assert_rows_match_hf(model.hf, workload.rows)
    target(float(engine.scheduler.preemptions["swap"]), label="swap preemptions")


@settings(max_examples=30, deadline=None, suppress_health_check=SLOW_DATA)
@given(data=st.data(), mode=st.sampled_from(["recompute", "swap"]),
       hash_name=st.sampled_from(["ignores-first-token", "constant"]), num_blocks=st.integers(8, 16),
       budget=st.integers(1, 24), max_requests=st.integers(3, 8))
def test_colliding_hash_functions_never_make_a_sequence_read_another_prefix(
        model, data, mode, hash_name, num_blocks, budget, max_requests):
    """Prompts built from blocks that collide under these hash functions: hits must be confirmed."""
    engine = make_engine(model, mode=mode, hash_name=hash_name, num_blocks=num_blocks, num_host_blocks=8,
                         max_num_seqs=4, budget=budget)
    workload = Workload(data, engine)
    workload.run(max_requests, forms=("blocks",))
    assert_rows_match_hf(model.hf, workload.rows)


@settings(max_examples=15, deadline=None, suppress_health_check=SLOW_DATA)
@given(prompt_list=st.lists(prompts(), min_size=1, max_size=3), beam_width=st.integers(1, 3),
       max_tokens=st.integers(1, 6), mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       num_blocks=st.integers(6, 12))
def test_beam_search_forks_and_frees_beams_and_scores_them_as_hf_does(
        model, prompt_list, beam_width, max_tokens, mode, caching, num_blocks):
    """Beams share their parent's blocks (copy-on-write for the partial last block) and parents are freed.

    Every returned hypothesis' cumulative logprob must be HF's log-softmax summed over its generated
    tokens (so every beam read the right K/V), and afterwards the pool is complete.
    """
    engine = make_engine(model, mode=mode, caching=caching, num_blocks=num_blocks, num_host_blocks=8)
    outputs = beam_search(engine, prompt_list, BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens,
                                                                ignore_eos=True))
    assert_pool_complete(engine)
    assert not engine.has_unfinished_requests()
    for prompt, output in zip(prompt_list, outputs, strict=True):
        assert len(output.sequences) == beam_width  # EOS ignored: every beam lives to the end
        for hypothesis in output.sequences:
            assert hypothesis.tokens[:len(prompt)] == prompt
            generated = len(hypothesis.tokens) - len(prompt)
            assert generated == max_tokens  # prompts of at most 16 tokens + 6 fit max_model_len (24 or more)
            with torch.no_grad():
                logprobs = torch.log_softmax(model.hf(torch.tensor([hypothesis.tokens])).logits[0].float(), dim=-1)
            expected = sum(float(logprobs[position - 1, hypothesis.tokens[position]])
                           for position in range(len(prompt), len(hypothesis.tokens)))
            assert abs(hypothesis.cum_logprob - expected) <= LOGITS_TOLERANCE * generated, (
                hypothesis.cum_logprob, expected)
