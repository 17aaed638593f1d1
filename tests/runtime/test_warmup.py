"""The warm-up plan covers every kernel-variant class a step can have, and running it caches nothing."""

from __future__ import annotations

import pytest
import torch

from octavo.runtime.model_runner import ModelRunner
from octavo.runtime.step_buffers import batch_size_ladder
from octavo.runtime.warmup import integer_class, step_classes, warm_up, warmup_inputs, warmup_steps
from tests.runtime.engine_helpers import make_engine

BLOCK_SIZE = 16


def reachable_classes(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> set[tuple]:
    """By enumeration: the classes of every non-decode step (T > B) the limits allow, its table W blocks wide.

    Some sequence's context lies in ((W - 1) * block_size, W * block_size]; every query fits its own context,
    so the longest query, at best ceil(T / B) tokens, fits min(W * block_size, max_model_len).
    """
    classes = set()
    for num_tokens in range(2, min(max_num_batched_tokens, 100) + 1):
        for num_seqs in range(1, min(num_tokens - 1, max_num_seqs) + 1):
            for width in range(1, 40):
                if (width - 1) * BLOCK_SIZE >= max_model_len:
                    break
                if -(-num_tokens // num_seqs) <= min(width * BLOCK_SIZE, max_model_len):
                    classes.add(step_classes(num_tokens, num_seqs, width))
    return classes


def test_integer_classes_are_tritons():
    assert [integer_class(value) for value in (1, 2, 15, 16, 17, 32, 48)] == [
        "one", "other", "other", "16", "other", "16", "16"]


@pytest.mark.parametrize(("max_num_seqs", "max_num_batched_tokens", "max_model_len"), [
    (8, 1024, 512), (40, 8192, 4096), (256, 8192, 131072), (1, 20, 512), (12, 30, 24), (4, 2, 8)])
def test_plan_has_the_ladder_and_one_step_of_every_reachable_class(max_num_seqs, max_num_batched_tokens,
                                                                   max_model_len):
    ladder = batch_size_ladder(max_num_seqs)
    steps = warmup_steps(ladder, max_num_batched_tokens, max_num_seqs, max_model_len, BLOCK_SIZE)
    decodes = [step for step in steps if step.is_decode]
    assert [len(step.query_lens) for step in decodes] == ladder
    others = [step for step in steps if not step.is_decode]
    planned = [step_classes(step.num_tokens, len(step.query_lens), -(-step.context_len // BLOCK_SIZE))
               for step in others]
    assert len(planned) == len(set(planned))  # no class twice
    assert set(planned) == reachable_classes(max_num_batched_tokens, max_num_seqs, max_model_len)
    for step in others:  # each is a step the scheduler could make
        assert step.num_tokens <= max_num_batched_tokens and len(step.query_lens) <= max_num_seqs
        assert max(step.query_lens) == step.query_lens[-1] <= step.context_len <= max_model_len


def test_inputs_cache_nothing_and_attend_over_the_context():
    step = next(step for step in warmup_steps([1], 1024, 16, 512, BLOCK_SIZE)
                if step.num_tokens == 32 and len(step.query_lens) == 2 and step.context_len == 256)
    inputs = warmup_inputs(step, BLOCK_SIZE)
    assert step.query_lens == (16, 16)
    assert torch.equal(inputs.slot_mapping, torch.full((32,), -1))
    assert inputs.block_tables.shape == (2, 16) and not inputs.block_tables.any()
    assert inputs.seq_lens.tolist() == [16, 256] and inputs.query_start_loc.tolist() == [0, 16, 32]
    assert torch.equal(inputs.positions, torch.cat([torch.arange(16), torch.arange(240, 256)]))
    assert inputs.logits_indices.tolist() == [15, 31] and inputs.sampled_rows == [0, 1]


def test_warm_up_runs_every_step_on_its_ladder_size_and_writes_no_cache_slot(artifact):
    engine = make_engine(artifact, backend="torch", num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=40,
                         max_model_len=256)
    caches = engine.kv_cache.tensors
    for tensor in caches.values():
        tensor.fill_(float("nan"))
    before = {name: tensor.clone() for name, tensor in caches.items()}
    runner = ModelRunner(engine.executor, caches, 4, 16, engine.device, pad_decodes=True, cuda_graphs=False)
    steps = warmup_steps(runner.buffers.ladder, 40, 4, 256, BLOCK_SIZE)
    sizes = []
    execute = runner.execute
    runner.execute = lambda feed: sizes.append((feed.size, feed.tensors["input_ids"].shape[0])) or execute(feed)
    warm_up(runner, steps, BLOCK_SIZE)
    assert sizes == [(size, size) for size in (1, 2, 4)] + [(None, step.num_tokens) for step in steps[3:]]
    assert len(steps) > 3 + 6
    for name, tensor in caches.items():  # bitwise: NaN payloads included
        assert torch.equal(tensor.view(torch.int32), before[name].view(torch.int32)), name
