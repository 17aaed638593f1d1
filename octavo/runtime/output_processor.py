"""Turning a step's logits into tokens, logprobs, text and finished sequences."""

from __future__ import annotations

import logging
import time

import torch

from octavo.runtime.outputs import Logprob
from octavo.runtime.request import Request
from octavo.runtime.sampler import Sampler, SamplerOutput, SamplingRow
from octavo.runtime.scheduler import Scheduler
from octavo.runtime.sequence import Sequence, SequenceStatus
from octavo.runtime.step_phases import StepPhases
from octavo.runtime.stop_checker import check_stop
from octavo.runtime.structured.manager import StructuredOutputManager
from octavo.runtime.structured.masks import StepMask

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Samples the next tokens of a step and applies them: append, detokenize, stop checks."""

    def __init__(self, sampler: Sampler, scheduler: Scheduler, tokenizer, eos_token_ids: list[int],
                 max_model_len: int, phases: StepPhases | None = None,
                 structured: StructuredOutputManager | None = None):
        self.phases = phases or StepPhases()
        self.structured = structured
        self.sampler = sampler
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def sample_and_append(self, rows: list[tuple[Sequence, int]], logits: torch.Tensor,
                          step_mask: StepMask | None = None) -> None:
        """`rows` pairs each sequence with its logits row (parallel samples share their parent's row).

        `step_mask` holds the banned tokens of the constrained rows, computed during the step; without
        it, constrained sequences' masks are computed here.
        """
        if not rows:
            return
        with self.phases.time("sample"):
            row_ids = [row for _, row in rows]
            sequences = [seq for seq, _ in rows]
            banned = self._banned(sequences, row_ids, step_mask, logits.device)
            if row_ids != list(range(logits.shape[0])):  # forks share a row; prompt-logprob rows follow
                logits = logits.index_select(0, torch.tensor(row_ids, device=logits.device))
            sampling_rows = [SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_view, seq.generator)
                             for seq in sequences]
            # Logprobs (a full-vocabulary log_softmax per row) only for the rows whose request shows them.
            logprob_rows = [index for index, seq in enumerate(sequences) if seq.params.logprobs is not None]
            result = self.sampler(logits, sampling_rows, logprob_rows, banned)
            token_ids = result.token_ids.tolist()
            logprobs = result.sampled_logprobs.tolist()
        with self.phases.time("detokenize"):
            self._append(sequences, result, token_ids, logprobs)

    def _banned(self, sequences: list[Sequence], row_ids: list[int], step_mask: StepMask | None,
                device: torch.device) -> torch.Tensor | None:
        if step_mask is not None:
            return step_mask.select(row_ids, device)
        if self.structured is None or all(seq.grammar is None for seq in sequences):
            return None
        return self.structured.banned_now(sequences, device)

    def _append(self, sequences: list[Sequence], result: SamplerOutput, token_ids: list[int],
                logprobs: list[float]) -> None:
        """Append each sequence's token, its logprobs and its text delta; finish the ones that stop."""
        for index, seq in enumerate(sequences):
            entry = self.logprob_entry(result, index, seq.params.logprobs) if seq.output_logprobs is not None else None
            self.append_token(seq, token_ids[index], logprobs[index], entry)

    def append_token(self, seq: Sequence, token_id: int, logprob: float, logprob_entry: dict | None) -> bool:
        """Append one chosen token with its logprob (entry) and text; stop checks. Returns whether `seq` finished."""
        if seq.grammar is not None and not seq.grammar.accept(token_id):
            # Only a row whose mask allowed nothing samples a refused token: the grammar reached a state that no
            # token of this vocabulary continues. That sequence ends here; the rest of the batch goes on.
            logger.warning("sequence %s: its grammar allows no token of this vocabulary after %d tokens; aborted",
                           seq.seq_id, seq.num_output_tokens)
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            seq.finish_time = time.monotonic()
            return True
        seq.append_token(token_id)
        if seq.params.logprobs is not None:  # other rows' logprobs are not computed (NaN)
            seq.cumulative_logprob += logprob
        if seq.output_logprobs is not None:
            seq.output_logprobs.append(logprob_entry)
        delta = seq.detokenizer.append([token_id])
        seq.output_text += delta
        self._check_stop(seq, len(delta))
        return seq.is_finished

    def _check_stop(self, seq: Sequence, new_text_len: int) -> None:
        decision = check_stop(seq.params, self.eos_token_ids, seq.output_token_view, seq.output_text,
                              new_text_len, seq.num_tokens, self.max_model_len)
        if not decision.finished:
            if seq.grammar is not None and seq.grammar.is_terminated:
                # The grammar took its stop token (with ignore_eos, say): nothing may follow it.
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
                seq.finish_time = time.monotonic()
            return
        if decision.truncate_text_to is not None:
            seq.output_text = seq.output_text[:decision.truncate_text_to]
        seq.stop_reason = decision.stop_reason
        status = SequenceStatus.FINISHED_STOPPED if decision.finish_reason == "stop" else SequenceStatus.FINISHED_LENGTH
        self.scheduler.finish(seq, status)
        seq.finish_time = time.monotonic()

    def logprob_entry(self, result: SamplerOutput, row: int, num_top: int) -> dict[int, Logprob]:
        """The chosen token's logprob and rank, plus the top `num_top` tokens of that row."""
        token = int(result.token_ids[row])
        entry = {token: Logprob(float(result.sampled_logprobs[row]), int(result.sampled_ranks[row]),
                                self.tokenizer.decode([token]))}
        if num_top and result.top_token_ids is not None:
            pairs = zip(result.top_token_ids[row, :num_top].tolist(), result.top_logprobs[row, :num_top].tolist(),
                        strict=True)
            for rank, (token_id, value) in enumerate(pairs, 1):
                entry.setdefault(token_id, Logprob(value, rank, self.tokenizer.decode([token_id])))
        return entry

    def add_prompt_logprobs(self, request: Request, logits: torch.Tensor, start: int) -> None:
        """Score prompt tokens start+1 .. start+len(logits) with the logits rows of positions start.. ."""
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]  # nothing predicts the first prompt token
        count = logits.shape[0]
        tokens = request.prompt_token_ids[start:start + count + 1]
        scores = self.sampler.prompt_logprobs(logits, tokens, request.params.prompt_logprobs)
        values, ranks = scores.logprobs.tolist(), scores.ranks.tolist()
        top_values, top_ids = scores.top_logprobs.tolist(), scores.top_token_ids.tolist()
        for offset in range(count):
            position = start + offset + 1
            if position != len(request.prompt_logprobs):
                continue  # already scored before a preemption made the prompt be recomputed
            token = tokens[offset + 1]
            entry = {token: Logprob(values[offset], ranks[offset], self.tokenizer.decode([token]))}
            for rank, (token_id, value) in enumerate(zip(top_ids[offset], top_values[offset], strict=True), 1):
                entry.setdefault(token_id, Logprob(value, rank, self.tokenizer.decode([token_id])))
            request.prompt_logprobs.append(entry)
