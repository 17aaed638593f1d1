"""Static, persistent input buffers for decode steps, padded to a ladder of batch sizes.

A decode step (every scheduled sequence computes one token and samples) of n
sequences runs at the smallest ladder size b >= n: 1, 2, 4, 8, then steps of
8 up to max_num_seqs. Its inputs are written into the first b rows of tensors
allocated once, so a step allocates nothing, every step of one size has the
same shapes and addresses (what a CUDA graph replays), and a compiled graph
sees few distinct shapes.

The b - n padding rows repeat the last real sequence (its token, position,
block table row and length) with slot -1: the KV write skips them (negative
slots are never written), each computes exactly what that sequence computes,
and batch-level choices of attention kernels (the longest context, blocks all
sequences share) are the unpadded batch's. Their logits rows are ignored.
"""

from __future__ import annotations

import torch

from octavo.runtime.input_batch import StepInputs

PAD_SLOT = -1
LADDER_STEP = 8


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to and including max_num_seqs (which ends the ladder)."""
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
    size = LADDER_STEP
    while size < max_num_seqs:
        sizes.append(size)
        size += LADDER_STEP
    return [*sizes, max_num_seqs]


def is_decode_step(inputs: StepInputs) -> bool:
    """Every sequence of the step computes exactly one token and samples it (no prompt logprob rows)."""
    num_seqs = inputs.seq_lens.shape[0]
    return (inputs.input_ids.shape[0] == num_seqs and len(inputs.sampled_rows) == num_seqs
            and not inputs.prompt_rows)


class DecodeBuffers:
    """The persistent decode inputs: rows for max_num_seqs sequences, block tables `max_blocks` wide."""

    def __init__(self, max_num_seqs: int, max_blocks: int, device: torch.device):
        self.ladder = batch_size_ladder(max_num_seqs)
        self.max_blocks = max_blocks
        size = self.ladder[-1]
        self.tensors = {
            "input_ids": torch.zeros(size, dtype=torch.int64, device=device),
            "positions": torch.zeros(size, dtype=torch.int64, device=device),
            "slot_mapping": torch.full((size,), PAD_SLOT, dtype=torch.int64, device=device),
            "block_tables": torch.zeros(size, max_blocks, dtype=torch.int32, device=device),
            "seq_lens": torch.ones(size, dtype=torch.int32, device=device),
            "query_start_loc": torch.arange(size + 1, dtype=torch.int32, device=device),
            "logits_indices": torch.arange(size, dtype=torch.int64, device=device),
        }
        self._views: dict[int, dict[str, torch.Tensor]] = {}

    def bucket(self, num_seqs: int) -> int | None:
        """The ladder size a decode step of `num_seqs` sequences runs at (None: larger than the ladder)."""
        for size in self.ladder:
            if size >= num_seqs:
                return size
        return None

    def views(self, size: int) -> dict[str, torch.Tensor]:
        """The inputs of a step at ladder size `size`: the first `size` rows of every buffer (made once
        per size: the buffers never move)."""
        views = self._views.get(size)
        if views is None:
            views = {name: tensor[:size] for name, tensor in self.tensors.items()}
            views["query_start_loc"] = self.tensors["query_start_loc"][:size + 1]
            self._views[size] = views
        return views

    def fill(self, inputs: StepInputs, size: int) -> dict[str, torch.Tensor]:
        """Write a decode step's inputs (n <= size sequences) into the buffers, padded to `size`; the views.

        `inputs` holds one token per sequence in order, so token b is sequence b's and its logits
        row is row b: query_start_loc and logits_indices keep their constant 0..size contents.
        """
        num_seqs = inputs.seq_lens.shape[0]
        width = inputs.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"a block table of {width} blocks exceeds the decode buffers' {self.max_blocks}")
        buffers = self.tensors
        last = num_seqs - 1
        padding = size - num_seqs
        for name in ("input_ids", "positions", "seq_lens"):
            buffers[name][:num_seqs].copy_(getattr(inputs, name), non_blocking=True)
            if padding:
                buffers[name][num_seqs:size].copy_(buffers[name][last:num_seqs].expand(padding))
        buffers["slot_mapping"][:num_seqs].copy_(inputs.slot_mapping, non_blocking=True)
        tables = buffers["block_tables"]
        tables[:num_seqs, :width].copy_(inputs.block_tables, non_blocking=True)
        tables[:num_seqs, width:].zero_()
        if padding:
            buffers["slot_mapping"][num_seqs:size].fill_(PAD_SLOT)
            tables[num_seqs:size].copy_(tables[last:num_seqs].expand(padding, -1))
        return self.views(size)
