"""The engine's structured output: grammars per request, masks per step, proposals checked.

`StructuredOutputManager` owns the grammar cache and the mask worker of one engine:

- `start(params)`: the GrammarState a new constrained sequence begins in (its grammar compiled, or
  found in the cache);
- `submit_step(schedule, inputs)`: before the model runs, start computing the step's masks on the
  worker (None when no sampled row of the step is constrained); the engine takes the result after
  the model step;
- `banned_now(sequences)`: the masks of some sequences computed at once (steps that did not submit
  theirs: pipelined batches, beam search rounds);
- `check_proposals(seq, tokens)`: the longest prefix of speculative proposals the grammar allows.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from octavo.runtime.input_batch import StepInputs
from octavo.runtime.scheduler import SchedulerOutput
from octavo.runtime.sequence import Sequence
from octavo.runtime.structured.grammars import GrammarCache
from octavo.runtime.structured.masks import MaskJob, MaskWorker, compute_step_mask
from octavo.runtime.structured.matcher import GrammarState
from octavo.runtime.structured.spec import StructuredOutputs


class StructuredOutputManager:
    """See the module docstring."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.grammars = GrammarCache(tokenizer, vocab_size, stop_token_ids)
        self.worker = MaskWorker(vocab_size)

    def start(self, spec: StructuredOutputs) -> GrammarState:
        """The initial state of a sequence constrained by `spec`; GrammarError when it cannot compile."""
        return GrammarState.start(self.grammars.compile(spec))

    def submit_step(self, schedule: SchedulerOutput, inputs: StepInputs) -> Future | None:
        """Start the StepMask of the step's constrained sampled rows (and their proposals' rows)."""
        jobs = []
        for row, index in enumerate(inputs.sampled_rows):
            item = schedule.scheduled[index]
            if item.seq.grammar is None:
                continue
            job = MaskJob(item.seq.grammar, row)
            if index in inputs.spec_rows:
                first, count = inputs.spec_rows[index]
                job.spec_tokens, job.spec_rows = list(item.spec_token_ids), list(range(first, first + count))
            jobs.append(job)
        if not jobs:
            return None
        return self.worker.submit(jobs, inputs.logits_indices.shape[0])

    def banned_now(self, sequences: list[Sequence], device: torch.device) -> torch.Tensor | None:
        """bool [len(sequences), vocab]: each sequence's banned next tokens, computed now (None: none constrained)."""
        jobs = [MaskJob(seq.grammar, row) for row, seq in enumerate(sequences) if seq.grammar is not None]
        if not jobs:
            return None
        return compute_step_mask(jobs, len(sequences), self.vocab_size).banned.to(device)

    @staticmethod
    def check_proposals(seq: Sequence, token_ids: list[int]) -> list[int]:
        """The leading proposals of `seq` its grammar allows (all of them for an unconstrained sequence)."""
        if seq.grammar is None:
            return token_ids
        return token_ids[:seq.grammar.valid_prefix(token_ids)]

    def shutdown(self) -> None:
        self.worker.shutdown()
