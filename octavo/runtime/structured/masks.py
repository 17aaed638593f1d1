"""The token masks of one step, computed on a worker thread while the model runs (where a core is spare).

Which tokens a sequence may sample next depends only on the tokens it already has, all known when
the step is scheduled. So the engine hands the step's constrained rows to `MaskWorker.submit`
before it runs the model, and collects the result after: the grammar work overlaps the model (whose
ATen kernels release the GIL) instead of following it.

A job is one sequence: its sampled row, and for speculative decoding the rows of its proposed
tokens, each predicting the token after one more proposal. The worker fills the sampled row at the
sequence's state, then accepts the proposals one by one, filling each next row, and rolls them all
back: the sequence's state is what it was. Rows past a proposal the grammar rejects (verification
rejects that proposal, so they are never sampled) and rows of unconstrained sequences allow every
token. The packed bitmask is unpacked into `StepMask.banned`, bool [rows, vocab], True where the
grammar forbids the token, which the sampler applies in one masked fill.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from octavo.runtime.structured.matcher import GrammarState

# byte -> its 8 bits, True where the bit is 0 (token banned). xgrammar packs token 32 * w + b into bit b of
# int32 word w; read as little-endian bytes, byte k of word w holds tokens 32 * w + 8 * k + (0..7).
_BANNED_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass
class MaskJob:
    """One constrained sequence of a step: its state, its sampled row, its proposals and their rows."""

    state: GrammarState
    row: int
    spec_tokens: list[int] = field(default_factory=list)
    spec_rows: list[int] = field(default_factory=list)


@dataclass
class StepMask:
    """Banned tokens per logits row of a step: `banned` bool [rows, vocab] (all False: unconstrained row)."""

    banned: torch.Tensor
    constrained_rows: frozenset[int]

    def select(self, rows: list[int], device: torch.device) -> torch.Tensor | None:
        """`banned` of `rows` in that order, on `device`; None when none of them is constrained."""
        if self.constrained_rows.isdisjoint(rows):
            return None
        if rows == list(range(self.banned.shape[0])):
            return self.banned.to(device, non_blocking=True)
        return self.banned.index_select(0, torch.tensor(rows)).to(device, non_blocking=True)


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def banned_from_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size], True where a bit of the int32 [rows, words] bitmask is 0."""
    if not _LITTLE_ENDIAN:
        shifts = torch.arange(32, dtype=torch.int32)
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1
        return (bits == 0).view(bitmask.shape[0], -1)[:, :vocab_size]
    as_bytes = bitmask.view(torch.uint8).long()
    return _BANNED_BITS[as_bytes].view(bitmask.shape[0], -1)[:, :vocab_size]


def mask_banned_tokens(logits: torch.Tensor, raw_logits: torch.Tensor, banned: torch.Tensor,
                       emptiable_rows: list[int]) -> torch.Tensor:
    """`logits` [N, V] with the `banned` [N, V] tokens at -inf, one masked fill for the batch (a new tensor).

    Of `emptiable_rows` (rows whose other processing banned tokens too: min_tokens' stop tokens), one
    left with no token at all (its grammar allows only stopping) is the raw logits under the grammar alone.
    """
    masked = logits.masked_fill(banned, float("-inf"))
    if emptiable_rows:
        index = torch.tensor(emptiable_rows, dtype=torch.int64, device=logits.device)
        emptied = index[masked[index].amax(dim=-1) == float("-inf")]
        if len(emptied):
            masked[emptied] = raw_logits[emptied].to(masked.dtype).masked_fill(banned[emptied], float("-inf"))
    return masked


def compute_step_mask(jobs: list[MaskJob], num_rows: int, vocab_size: int) -> StepMask:
    """The StepMask of `jobs` over `num_rows` logits rows (see the module docstring)."""
    bitmask = torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    constrained = set()
    for job in jobs:
        job.state.fill(bitmask, job.row)
        constrained.add(job.row)
        accepted = 0
        for token_id, row in zip(job.spec_tokens, job.spec_rows, strict=True):
            if not job.state.accept(token_id):
                break
            accepted += 1
            if job.state.is_terminated:
                break  # a stop token ends the output: nothing after it is sampled
            job.state.fill(bitmask, row)
            constrained.add(row)
        job.state.rollback(accepted)
    return StepMask(banned_from_bitmask(bitmask, vocab_size), frozenset(constrained))


def spare_core() -> bool:
    """Whether a core is left beside the model's threads. Without one, a grammar thread running during the
    model step preempts one of its OpenMP threads, and every parallel region then waits for that thread: on
    2 cores with 2 threads the 64-sequence decode step of SmolLM2 took 98 ms instead of 66 ms that way, for
    masks that cost ~3 ms computed alone."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores > torch.get_num_threads()


class MaskWorker:
    """One thread computing step masks (started on first use), where a core is spare (`spare_core`);
    elsewhere the masks are computed at submission, before the model step, on the calling thread."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, jobs: list[MaskJob], num_rows: int) -> Future:
        """Start computing the StepMask of `jobs`; the states must not be touched until it is done."""
        if not spare_core():
            done: Future = Future()
            done.set_result(compute_step_mask(jobs, num_rows, self.vocab_size))
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="octavo-grammar")
        return self._pool.submit(compute_step_mask, jobs, num_rows, self.vocab_size)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
