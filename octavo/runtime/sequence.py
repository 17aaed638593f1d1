"""Sequences and requests: the runtime's per-request state."""

from __future__ import annotations

import collections.abc
import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from octavo.runtime.detokenizer import IncrementalDetokenizer
from octavo.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from octavo.runtime.structured.matcher import GrammarState


class OutputTokenIds(collections.abc.Sequence):
    """The output part of a token list (the ids from `start` on), read in place: the per-token stop checks
    and the sampler's rows take it every step, and a slice copied the whole output each time."""

    __slots__ = ("_start", "_tokens")

    def __init__(self, tokens: list[int], start: int) -> None:
        self._tokens = tokens
        self._start = start

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):  # only the ids the slice names are read, not a copy of the whole output
            return [self._tokens[i] for i in range(self._start, len(self._tokens))[index]]
        length = len(self)
        position = index + length if index < 0 else index
        if not 0 <= position < length:
            raise IndexError(f"output token index {index} out of range for {length} tokens")
        return self._tokens[self._start + position]

    def __iter__(self):
        return itertools.islice(self._tokens, self._start, None)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Sequence:
    """One generated continuation: its tokens, its KV blocks and how much of it is in the cache.

    `token_ids` is prompt + output. The first `num_computed_tokens` of them
    have their K/V in the blocks of `block_table`; a step schedules some of
    the rest (a prefill chunk, or the one newest token when decoding).
    """

    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    output_text: str = ""
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    output_logprobs: list[dict[int, float]] | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    host_block_table: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    grammar: GrammarState | None = None  # where a structured-output sequence is in its grammar
    lora_name: str | None = None  # the LoRA adapter the sequence runs under (None: the base model)
    _block_hashes: list[int] = field(default_factory=list, repr=False)
    # Where BlockManager.cache_full_blocks resumes: (blocks entered, last entered block id, its cache id).
    cache_walk: tuple[int, int, int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = []

    @property
    def seq_id(self) -> str:
        return f"{self.request_id}#{self.index}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def output_token_view(self) -> OutputTokenIds:
        """output_token_ids without the copy (it follows the tokens appended later)."""
        return OutputTokenIds(self.token_ids, self.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def block_hashes(self, block_manager) -> list[int]:
        """Hash chain of the sequence's full blocks of tokens (computed incrementally, then kept)."""
        size = block_manager.block_size
        while len(self._block_hashes) < len(self.token_ids) // size:
            index = len(self._block_hashes)
            # Blocks computed under an adapter hold other K/V than the base model's: their chain starts elsewhere.
            parent = self._block_hashes[-1] if index else (hash(("lora", self.lora_name)) if self.lora_name else None)
            tokens = tuple(self.token_ids[index * size:(index + 1) * size])
            self._block_hashes.append(block_manager.hash_function(parent, tokens))
        return self._block_hashes

    def fork(self, index: int, generator: torch.Generator | None) -> Sequence:
        """A copy sharing this sequence's history (tokens, text, progress); blocks are forked separately."""
        child = Sequence(self.request_id, index, self.prompt_token_ids, self.params,
                         self.detokenizer.clone() if self.detokenizer is not None else None,
                         generator=generator, arrival_time=self.arrival_time, priority=self.priority,
                         token_ids=list(self.token_ids), num_computed_tokens=self.num_computed_tokens,
                         status=self.status, output_text=self.output_text,
                         cumulative_logprob=self.cumulative_logprob,
                         output_logprobs=list(self.output_logprobs) if self.output_logprobs is not None else None,
                         num_cached_tokens=self.num_cached_tokens, first_token_time=self.first_token_time,
                         grammar=self.grammar.fork() if self.grammar is not None else None, lora_name=self.lora_name)
        child._block_hashes = list(self._block_hashes)
        return child

    def reset_for_recompute(self) -> None:
        """Forget the cache state (after preemption by recompute): everything is recomputed."""
        self.block_table = []
        self.cache_walk = None
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
