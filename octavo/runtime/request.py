"""Request: a prompt, its sampling parameters and its sequences (n parallel samples)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from octavo.runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.sequence import Sequence
from octavo.runtime.stop_checker import held_back_length


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[Sequence] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    priority: int = 0
    aborted: bool = False
    _sent_text: dict[int, int] = field(default_factory=dict)
    _sent_tokens: dict[int, int] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """Rejected, or all n samples exist (siblings are forked after the prompt) and finished."""
        if self.error is not None or self.aborted:
            return True
        return len(self.sequences) == self.params.n and all(seq.is_finished for seq in self.sequences)

    @property
    def pending_forks(self) -> int:
        """Parallel samples not forked yet: they are forked from sample 0 once its prompt is computed."""
        return self.params.n - len(self.sequences)

    def make_output(self) -> RequestOutput:
        """Snapshot of the request; deltas are what is new since the previous snapshot.

        While a sample runs, the last characters that could begin a stop
        string are held back from the delta (they may still be cut off).
        """
        completions = [self._completion(seq) for seq in sorted(self.sequences, key=lambda seq: seq.index)]
        first_token = min((seq.first_token_time for seq in self.sequences if seq.first_token_time), default=None)
        finished_at = max((seq.finish_time or 0.0 for seq in self.sequences), default=None) if self.finished else None
        cached = max((seq.num_cached_tokens for seq in self.sequences), default=0)
        metrics = RequestMetrics(self.arrival_time, first_token, finished_at,
                                 sum(seq.num_preemptions for seq in self.sequences), cached)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, self.finished,
                             self.prompt_logprobs, self.error, metrics)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        visible = len(seq.output_text)
        if not seq.is_finished:
            visible = max(self._sent_text.get(seq.index, 0), visible - held_back_length(self.params))
        sent_text = self._sent_text.get(seq.index, 0)
        sent_tokens = self._sent_tokens.get(seq.index, 0)
        output_ids = seq.output_token_ids  # a fresh list: the output owns it
        self._sent_text[seq.index] = visible
        self._sent_tokens[seq.index] = len(output_ids)
        return CompletionOutput(
            index=seq.index,
            text=seq.output_text[:visible],
            token_ids=output_ids,
            cumulative_logprob=seq.cumulative_logprob if self.params.logprobs is not None else None,
            logprobs=list(seq.output_logprobs) if seq.output_logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            delta_text=seq.output_text[sent_text:visible],
            delta_token_ids=output_ids[sent_tokens:],
        )
