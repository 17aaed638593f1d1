"""ModelRunner: one step's inputs to the executor and back as logits.

Decode steps run on the persistent buffers of step_buffers, padded to the
batch-size ladder, when the executor is graph-ready: the compiled executor on
CPU (one package serves every size), CUDA graphs on CUDA (one capture per
size). Other steps (prefills, chunks, mixed steps, speculative verification)
and every step of the eager executor on CPU run on their own unpadded inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.runtime.cuda_graphs import CudaGraphs
from octavo.runtime.input_batch import StepInputs
from octavo.runtime.step_buffers import DecodeBuffers, is_decode_step


@dataclass
class StepFeed:
    """What one executor call reads: the inputs by name, the ladder size (None: unpadded), real rows."""

    tensors: dict[str, torch.Tensor]
    size: int | None
    num_rows: int


class ModelRunner:
    """Prepares and runs steps; `pad_decodes` turns on the ladder, `cuda_graphs` the captures."""

    def __init__(self, executor, kv_tensors: dict[str, torch.Tensor], max_num_seqs: int, max_blocks: int,
                 device: torch.device, pad_decodes: bool, cuda_graphs: bool):
        self.executor = executor
        self.kv_tensors = kv_tensors
        self.device = device
        self.buffers = DecodeBuffers(max_num_seqs, max_blocks, device) if pad_decodes or cuda_graphs else None
        self.graphs = CudaGraphs() if cuda_graphs else None
        self.last_size: int | None = None  # the ladder size of the last step (None: unpadded), for inspection

    def prepare(self, inputs: StepInputs) -> StepFeed:
        """The feed of a step: ladder buffers for a decode step (when padding), else its own tensors."""
        num_rows = inputs.logits_indices.shape[0]
        size = None
        if self.buffers is not None and is_decode_step(inputs):
            size = self.buffers.bucket(num_rows)
        if size is None:
            return StepFeed({**inputs.to(self.device).as_dict(), **self.kv_tensors}, None, num_rows)
        return StepFeed({**self.buffers.fill(inputs, size), **self.kv_tensors}, size, num_rows)

    def execute(self, feed: StepFeed) -> torch.Tensor:
        """Logits [num_rows, V] of the step (the rows of its logits_indices, in order)."""
        self.last_size = feed.size
        if feed.size is not None and self.graphs is not None:
            logits = self.graphs.run(feed.size, lambda: self.executor.run(feed.tensors))
            if logits is not None:
                # The graph's output is overwritten by the next replay: hand out a copy.
                return logits[:feed.num_rows].clone()
        return self.executor.run(feed.tensors)[:feed.num_rows]
