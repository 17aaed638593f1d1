"""ModelRunner's padded decode steps: the padding rows repeat the last sequence and write no cache slot."""

from __future__ import annotations

import pytest
import torch

from octavo.runtime.input_batch import build_step_inputs
from octavo.runtime.model_runner import ModelRunner
from octavo.runtime.scheduler import ScheduledSequence
from octavo.runtime.step_buffers import PAD_SLOT
from tests.runtime.engine_helpers import greedy, make_engine

PROMPT_LENGTHS = (5, 9, 13)  # three sequences: a decode step of 3 runs at ladder size 4
# The padded step's GEMMs have 4 rows instead of 3, so a real row's sums may run in another order:
# a few float32 ulps per GEMM, far below what a wrong slot, row or context would change.
PADDING_TOLERANCE = 1e-5


def written_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Flat cache slots whose bytes differ (NaN payloads compared as bits)."""
    changed = (before.view(torch.int32) != after.view(torch.int32)).flatten(2).any(dim=2)
    return set(torch.nonzero(changed.flatten()).flatten().tolist())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_rows_write_no_slot_and_real_rows_write_what_an_unpadded_step_writes(artifact, backend):
    engine = make_engine(artifact, backend=backend, num_kv_blocks=16, max_num_seqs=4)
    for tensor in engine.kv_cache.tensors.values():
        tensor.fill_(float("nan"))  # every slot no step wrote stays NaN
    generator = torch.Generator().manual_seed(3)
    for length in PROMPT_LENGTHS:
        engine.add_request(torch.randint(3, 49000, (length,), generator=generator).tolist(), greedy(4))
    while engine.scheduler.waiting or any(seq.num_output_tokens == 0 for seq in engine.scheduler.running):
        engine.step()
    sequences = engine.scheduler.running
    for seq in sequences:
        engine.block_manager.allocate(seq, seq.num_computed_tokens + 1)
    inputs = build_step_inputs([ScheduledSequence(seq, 1) for seq in sequences], engine.block_manager.block_size)
    runner = ModelRunner(engine.executor, engine.kv_cache.tensors, 4, 8, engine.device, pad_decodes=True,
                         cuda_graphs=False)
    before = {name: tensor.clone() for name, tensor in engine.kv_cache.tensors.items()}
    feed = runner.prepare(inputs)
    assert feed.size == 4 and feed.tensors["slot_mapping"].tolist() == [*inputs.slot_mapping.tolist(), PAD_SLOT]
    assert torch.equal(feed.tensors["block_tables"][3], feed.tensors["block_tables"][2])
    padded_logits = runner.execute(feed)
    padded = {name: tensor.clone() for name, tensor in engine.kv_cache.tensors.items()}

    real_slots = set(inputs.slot_mapping.tolist())
    for name, tensor in padded.items():
        assert written_slots(before[name], tensor) == real_slots, name
    # The same step unpadded, on the caches as they were before it.
    for name, tensor in engine.kv_cache.tensors.items():
        tensor.copy_(before[name])
    unpadded_logits = engine.executor.run({**inputs.as_dict(), **engine.kv_cache.tensors})
    slots = inputs.slot_mapping
    for name, tensor in engine.kv_cache.tensors.items():
        assert written_slots(before[name], tensor) == real_slots, name
        flat_padded, flat_unpadded = padded[name].flatten(0, 1)[slots], tensor.flatten(0, 1)[slots]
        assert (flat_padded - flat_unpadded).abs().max().item() <= PADDING_TOLERANCE, name
    assert (padded_logits - unpadded_logits).abs().max().item() <= PADDING_TOLERANCE
