"""Start-up timing of an executor on a few step shapes, so the cost model knows the machine from step one.

Dummy steps write nothing into the KV cache (every slot is -1, which the attention op skips) and read
whatever the blocks hold; their outputs are discarded. The online fit then follows the real steps.
"""

from __future__ import annotations

import time

import torch

from octavo.runtime.executor import GraphExecutor
from octavo.runtime.input_batch import StepInputs
from octavo.runtime.spec_decode.cost_model import StepCostModel

CONTEXT_TOKENS = 64
"""Context of every dummy sequence (attention cost grows with it; the online fit follows real lengths)."""

REPEATS = 3


def calibrate(cost: StepCostModel, executor: GraphExecutor, kv_tensors: dict[str, torch.Tensor], num_blocks: int,
              block_size: int, shapes: list[tuple[int, int]], device: torch.device) -> None:
    """Time each (sequences, query tokens per sequence) shape (the fastest of a few runs) into `cost`."""
    for num_seqs, query_len in shapes:
        feed = {**_dummy_inputs(num_seqs, query_len, num_blocks, block_size).to(device).as_dict(), **kv_tensors}
        seconds = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            executor.run(feed)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        cost.calibrate(num_seqs * query_len, num_seqs if query_len > 1 else 0, min(seconds[1:]))


def calibration_shapes(max_proposed: int, max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """Batches of 1, 4 and 16 sequences with 1 and 1 + k query tokens each, within the engine's limits."""
    shapes = []
    for num_seqs in (1, 4, 16):
        for query_len in (1, 1 + max_proposed):
            if num_seqs <= max_num_seqs and num_seqs * query_len <= max_num_batched_tokens:
                shapes.append((num_seqs, query_len))
    return shapes


def _dummy_inputs(num_seqs: int, query_len: int, num_blocks: int, block_size: int) -> StepInputs:
    context = CONTEXT_TOKENS + query_len
    blocks_per_seq = -(-context // block_size)
    num_tokens = num_seqs * query_len
    positions = (context - query_len + torch.arange(query_len)).repeat(num_seqs)
    block_tables = (torch.arange(num_seqs * blocks_per_seq) % num_blocks).view(num_seqs, blocks_per_seq)
    return StepInputs(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=positions.long(),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        block_tables=block_tables.int(),
        seq_lens=torch.full((num_seqs,), context, dtype=torch.int32),
        query_start_loc=(torch.arange(num_seqs + 1) * query_len).int(),
        logits_indices=torch.arange(num_tokens),
        sampled_rows=[],
    )
