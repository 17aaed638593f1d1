"""Step inputs: the flat token batch and attention metadata, built with vectorized tensor code."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from octavo.runtime.scheduler import ScheduledSequence


@dataclass
class StepInputs:
    """The runtime inputs of one graph call (names match the graph's placeholders)."""

    input_ids: torch.Tensor        # int64 [T]
    positions: torch.Tensor        # int64 [T]
    slot_mapping: torch.Tensor     # int64 [T]
    block_tables: torch.Tensor     # int32 [B, max_blocks]
    seq_lens: torch.Tensor         # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    logits_indices: torch.Tensor   # int64 [N]
    sampled_rows: list[int]        # scheduled entries (by index) that sample; their logits are rows 0..S-1
    prompt_rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    # scheduled index -> (first logits row, count) of prompt positions scored for prompt_logprobs,
    # rows S.. of the logits; the rows are consecutive token positions from the chunk's start
    spec_rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    # scheduled index -> (first logits row, count) of the positions of its proposed tokens (speculative
    # decoding), after the prompt rows; its sampled row is the position of its newest real token

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in
                ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                 "logits_indices")}

    def to(self, device: torch.device) -> StepInputs:
        moved = {name: tensor.to(device, non_blocking=True) for name, tensor in self.as_dict().items()}
        return StepInputs(**moved, sampled_rows=self.sampled_rows, prompt_rows=self.prompt_rows,
                          spec_rows=self.spec_rows)


def build_step_inputs(scheduled: list[ScheduledSequence], block_size: int) -> StepInputs:
    """Concatenate every scheduled sequence's new tokens into one flat batch.

    Sequence b contributes tokens [computed_b, computed_b + q_b) of its
    token list. Positions, slots and the sampled rows are derived with
    tensor arithmetic over all T tokens at once; a decode step (one token per
    sequence, every one sampled) from plain integers, a tensor per input.
    """
    if scheduled and all(item.num_new_tokens == 1 and item.samples and not item.spec_token_ids
                         for item in scheduled):
        return _decode_step_inputs(scheduled, block_size)
    lens = [item.num_new_tokens for item in scheduled]
    query_lens = torch.tensor(lens, dtype=torch.int64)
    starts = torch.tensor([item.seq.num_computed_tokens for item in scheduled], dtype=torch.int64)
    query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.int64)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    # In a decode step token b is sequence b's; repeat_interleave costs more than the rest of the step's
    # input building together (its parallel kernel), so it is left to steps with several tokens per sequence.
    one_each = all(count == 1 for count in lens)
    owner = (torch.arange(len(scheduled)) if one_each
             else torch.repeat_interleave(torch.arange(len(scheduled)), query_lens))
    positions = starts[owner] + torch.arange(num_tokens) - query_start_loc[owner]
    input_ids = torch.tensor(_new_token_ids(scheduled), dtype=torch.int64)
    block_tables = _padded_block_tables(scheduled)
    slot_mapping = block_tables[owner, positions // block_size].long() * block_size + positions % block_size
    sampled_rows = [index for index, item in enumerate(scheduled) if item.samples]
    num_spec = torch.tensor([len(item.spec_token_ids) for item in scheduled], dtype=torch.int64)
    logits_indices = (query_start_loc[1:] - 1 - num_spec)[sampled_rows]
    prompt_rows, extra = _prompt_logprob_rows(scheduled, query_start_loc, len(sampled_rows))
    spec_rows, spec_extra = _spec_rows(scheduled, query_start_loc, len(sampled_rows) + sum(map(len, extra)))
    if extra or spec_extra:
        logits_indices = torch.cat([logits_indices, *extra, *spec_extra])
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=(starts + query_lens).to(torch.int32),
        query_start_loc=query_start_loc.to(torch.int32),
        logits_indices=logits_indices,
        sampled_rows=sampled_rows,
        prompt_rows=prompt_rows,
        spec_rows=spec_rows,
    )


def _decode_step_inputs(scheduled: list[ScheduledSequence], block_size: int) -> StepInputs:
    """build_step_inputs of a step where sequence b computes its newest token, at position
    num_computed_tokens, and samples it: row b everywhere. No prompt logprob rows: the newest token
    is past the last prompt position that is scored."""
    num_seqs = len(scheduled)
    positions = [item.seq.num_computed_tokens for item in scheduled]
    slots = [item.seq.block_table[position // block_size] * block_size + position % block_size
             for item, position in zip(scheduled, positions, strict=True)]
    rows = list(range(num_seqs))
    return StepInputs(
        input_ids=torch.tensor([item.seq.token_ids[-1] for item in scheduled], dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=_padded_block_tables(scheduled),
        seq_lens=torch.tensor([position + 1 for position in positions], dtype=torch.int32),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        logits_indices=torch.tensor(rows, dtype=torch.int64),
        sampled_rows=rows,
    )


def _prompt_logprob_rows(scheduled: list[ScheduledSequence], query_start_loc: torch.Tensor,
                         first_row: int) -> tuple[dict[int, tuple[int, int]], list[torch.Tensor]]:
    """Extra logits rows for sequences that want prompt logprobs: positions p of this chunk with
    p < prompt_len - 1 (the logits at p score prompt token p + 1)."""
    rows: dict[int, tuple[int, int]] = {}
    indices: list[torch.Tensor] = []
    for index, item in enumerate(scheduled):
        seq = item.seq
        if seq.params.prompt_logprobs is None:
            continue
        start = seq.num_computed_tokens
        count = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1) - start
        if count <= 0:
            continue
        rows[index] = (first_row, count)
        first_row += count
        indices.append(int(query_start_loc[index]) + torch.arange(count))
    return rows, indices


def _spec_rows(scheduled: list[ScheduledSequence], query_start_loc: torch.Tensor,
               first_row: int) -> tuple[dict[int, tuple[int, int]], list[torch.Tensor]]:
    """Extra logits rows at the positions of proposed tokens (each scores the token after it)."""
    rows: dict[int, tuple[int, int]] = {}
    indices: list[torch.Tensor] = []
    for index, item in enumerate(scheduled):
        count = len(item.spec_token_ids)
        if count:
            rows[index] = (first_row, count)
            first_row += count
            indices.append(int(query_start_loc[index + 1]) - count + torch.arange(count))
    return rows, indices


def _new_token_ids(scheduled: list[ScheduledSequence]) -> list[int]:
    token_ids: list[int] = []
    for item in scheduled:
        start = item.seq.num_computed_tokens
        token_ids += item.seq.token_ids[start:start + item.num_real_tokens]
        token_ids += item.spec_token_ids
    return token_ids


def _padded_block_tables(scheduled: list[ScheduledSequence]) -> torch.Tensor:
    """[B, longest table] int32, zero-padded, built as one flat int32 array (a list per row costs
    more than the step's other inputs together at 64 sequences)."""
    tables = [item.seq.block_table for item in scheduled]
    width = max(max(map(len, tables), default=0), 1)
    padding = [0] * width
    flat: list[int] = []
    for table in tables:
        flat += table
        flat += padding[:width - len(table)]
    return torch.frombuffer(array("i", flat), dtype=torch.int32).view(len(tables), width)
