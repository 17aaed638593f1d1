"""Parallel engines on real worker processes (gloo on CPU) against the single-process engine.

Both engines get the same requests and the same KV pool, so they schedule
the same steps; every step's float32 logits must agree within 1e-5 (the
tolerance argument of tests/passes/test_shard_tensor_parallel.py: sharding
only reorders float32 sums). The workload mixes chunked prefill with
decodes, prefix-cache hits, parallel sampling (n=2, copy-on-write blocks),
preemption by swapping (block moves every rank must repeat) or recompute,
and prompt logprobs. The test process is rank 0; the worker ranks are
started once per engine fixture, and the last test of each engine kills
one of them.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from octavo.config import EngineConfig
from octavo.errors import WorkerFailedError
from octavo.parallel import create_engine
from octavo.runtime.loader import load_artifact
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import greedy, make_engine, random_tokens, run_to_completion

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5
TIMEOUT_S = 20.0  # collective timeout of the parallel engines: generous for a loaded 2-core machine
POOL = {"num_kv_blocks": 14, "max_num_batched_tokens": 48, "max_num_seqs": 6, "num_threads": 1}


def requests(seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """Two waves of requests: the second repeats prefixes of the first (prefix cache) and samples n=2."""
    rng = random.Random(seed)
    first = [random_tokens(rng, length) for length in (70, 9, 40)]
    wave = [(prompt, greedy(12)) for prompt in first]
    wave[1] = (first[1], greedy(12, prompt_logprobs=2))
    later = [(first[0][:48] + random_tokens(rng, 5), SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=10,
                                                                     ignore_eos=True)),
             (first[2][:32] + random_tokens(rng, 20), greedy(10))]
    return wave + later


def run_lockstep(reference, parallel, work: list[tuple[list[int], SamplingParams]]) -> None:
    """Step both engines together; the same schedule and logits within ATOL at every step, the same outputs."""
    outputs = {"reference": {}, "parallel": {}}
    for index, (prompt, params) in enumerate(work):
        for engine in (reference, parallel):
            engine.add_request(prompt, params, request_id=str(index))
        if index == 2:  # the first wave runs a few steps before the second arrives
            for _ in range(4):
                _step_both(reference, parallel, outputs)
    while reference.has_unfinished_requests() or parallel.has_unfinished_requests():
        _step_both(reference, parallel, outputs)
    for request_id, expected in outputs["reference"].items():
        got = outputs["parallel"][request_id]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs], request_id
    assert reference.scheduler.num_preemptions > 0 and reference.block_manager.stats.hit_tokens > 0
    assert_pool_full(parallel)


def _step_both(reference, parallel, outputs: dict) -> None:
    for name, engine in (("reference", reference), ("parallel", parallel)):
        for output in engine.step():
            if output.finished:
                outputs[name][output.request_id] = output
    expected, got = reference.last_step, parallel.last_step
    assert [(item.seq.seq_id, item.num_new_tokens) for item in got.schedule.scheduled] == \
        [(item.seq.seq_id, item.num_new_tokens) for item in expected.schedule.scheduled]
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=ATOL)


def kill_a_worker_and_check_the_error(engine, rank: int) -> None:
    """Kill `rank` mid-run: the next step fails within the collective timeout, naming it; later ones at once."""
    for index in range(3):
        engine.add_request(list(range(100 + index, 140 + index)), greedy(50), request_id=f"doomed-{index}")
    engine.step()
    os.kill(engine.parallel.workers.processes[rank].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match=f"rank {rank} was killed by signal SIGKILL"):
        for _ in range(100):
            engine.step()
    assert time.monotonic() - start < TIMEOUT_S
    with pytest.raises(WorkerFailedError, match=f"rank {rank}"):
        engine.step()
    engine.shutdown()


@pytest.fixture(scope="module")
def llama(tiny_artifact):
    return load_artifact(tiny_artifact("llama"))


@pytest.fixture(scope="module")
def tensor_parallel_engine(llama):
    engine = create_engine(llama, EngineConfig(**POOL, preemption_mode="swap", swap_space="1MiB",
                                               tensor_parallel_size=2, collective_timeout=TIMEOUT_S))
    yield engine
    engine.shutdown()


def test_tensor_parallel_engine_matches_the_single_process_engine(llama, tensor_parallel_engine):
    assert tensor_parallel_engine.kv_cache.layout["num_kv_heads"] == 1  # rank 0 caches its KV head only
    reference = make_engine(llama, **POOL, preemption_mode="swap", swap_space="1MiB")
    run_lockstep(reference, tensor_parallel_engine, requests())
    assert reference.scheduler.preemptions["swap"] > 0


def test_a_killed_tensor_parallel_worker_is_named(tensor_parallel_engine):
    kill_a_worker_and_check_the_error(tensor_parallel_engine, rank=1)


@pytest.fixture(scope="module")
def pipeline_engine(tiny_artifact):
    engine = create_engine(load_artifact(tiny_artifact("qwen3")),
                           EngineConfig(**POOL, pipeline_parallel_size=2, collective_timeout=TIMEOUT_S))
    yield engine
    engine.shutdown()


def test_pipeline_with_two_batches_in_flight_generates_the_same_tokens(tiny_artifact, pipeline_engine):
    assert pipeline_engine.pipeline.depth == 2
    reference = make_engine(load_artifact(tiny_artifact("qwen3")), **POOL)
    rng = random.Random(1)
    prompts = [random_tokens(rng, rng.randrange(4, 40)) for _ in range(10)]
    results = []
    for engine in (reference, pipeline_engine):
        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, greedy(16), request_id=f"pipelined-{index}")
        results.append({key: output.outputs[0].token_ids for key, output in run_to_completion(engine).items()})
    assert results[1] == results[0]
    assert_pool_full(pipeline_engine)


def test_pipeline_with_one_batch_in_flight_matches_step_by_step(tiny_artifact, pipeline_engine):
    pipeline_engine.pipeline.depth = 1  # the same schedule as the single-process engine, step for step
    reference = make_engine(load_artifact(tiny_artifact("qwen3")), **POOL)
    run_lockstep(reference, pipeline_engine, requests(seed=2))
    assert reference.scheduler.preemptions["recompute"] > 0


def test_a_killed_pipeline_worker_is_named(pipeline_engine):
    kill_a_worker_and_check_the_error(pipeline_engine, rank=1)
