"""The warm-up of a CUDA engine: every kernel variant a step can need is compiled, every ladder size captured.

Triton compiles a kernel once per combination of its constexprs and of the
class of each integer argument (equal to 1, divisible by 16, or neither; an
argument equal to 1 even becomes a constant), and the Triton backend's
launchers pick their constexprs from the model alone, except the quantized
linear's row tile (16 rows up to 16 tokens, 64 above). So what a step
compiles depends on its shapes only through these classes of three numbers:
its token count T, its sequence count B, and the width W of its block table
(the row stride the attention kernels read it with), plus T <= 16.

The warm-up runs one step of each class combination the engine can schedule
(`warmup_steps`): every ladder size as a decode step (T = B, the ladder's
width), which a CUDA engine captures as a graph on the way, and prefills and
mixed steps (T > B) over the classes of T, B and W that fit the token budget,
the sequence cap and the model length. Their tokens carry slot -1, so nothing
is written to the KV cache; they attend over block 0 (its contents do not
matter: the logits are discarded). Without it, a new shape compiled its
kernels inside the first real steps: a first run of a workload 2-4x slower
than the second.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from octavo.runtime.input_batch import StepInputs
from octavo.runtime.step_buffers import PAD_SLOT

logger = logging.getLogger(__name__)

SEARCH_LIMIT = 48
"""Token and sequence counts searched for non-decode steps: every class of T and of B has its smallest member at
or below 32 (2 or 3, 16, 17, 32; 1, 2, 16)."""
TABLE_WIDTHS = (1, 2, 16)
"""Block-table widths of the non-decode warm-up steps, the smallest of each class: W equal to 1, neither,
divisible by 16."""


@dataclass(frozen=True)
class WarmupStep:
    """A step to warm up: each sequence's query length and context length (the last sequence sets W)."""

    query_lens: tuple[int, ...]
    context_len: int

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode(self) -> bool:
        return all(length == 1 for length in self.query_lens)


def integer_class(value: int) -> str:
    """How Triton specializes an integer argument: "one", "16" (divisible by 16) or "other"."""
    return "one" if value == 1 else "16" if value % 16 == 0 else "other"


def step_classes(num_tokens: int, num_seqs: int, table_width: int) -> tuple:
    """The variant-deciding classes of a step: T's, B's and W's integer classes, and T <= 16."""
    return (integer_class(num_tokens), integer_class(num_seqs), integer_class(table_width), num_tokens <= 16)


def warmup_steps(ladder: list[int], max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 block_size: int) -> list[WarmupStep]:
    """The steps that compile every variant (module docstring): the ladder's decodes, then, for each class
    combination of (T, B, W) that a non-decode step can have under the token budget, the sequence cap and
    max_model_len, its smallest step (T > B: some sequence has several query tokens, split evenly)."""
    steps = [WarmupStep((1,) * size, 1) for size in ladder]
    seen: set[tuple] = set()
    for width in TABLE_WIDTHS:
        context_len = min(width * block_size, max_model_len)
        if context_len <= (width - 1) * block_size:
            continue
        for num_tokens in range(2, min(max_num_batched_tokens, SEARCH_LIMIT) + 1):
            for num_seqs in range(1, min(num_tokens - 1, max_num_seqs) + 1):
                classes = step_classes(num_tokens, num_seqs, width)
                if -(-num_tokens // num_seqs) <= context_len and classes not in seen:
                    seen.add(classes)
                    steps.append(WarmupStep(_even_split(num_tokens, num_seqs), context_len))
    return steps


def _even_split(num_tokens: int, num_seqs: int) -> tuple[int, ...]:
    """`num_tokens` query tokens over `num_seqs` sequences as evenly as possible, the longest last."""
    base, extra = divmod(num_tokens, num_seqs)
    return (base,) * (num_seqs - extra) + (base + 1,) * extra


def warmup_inputs(step: WarmupStep, block_size: int) -> StepInputs:
    """Inputs of `step`: token 0 everywhere, every slot -1 (nothing cached), every block table row block 0.

    The last sequence has a context of `step.context_len` tokens (its table sets the width); the others'
    contexts are their query tokens. Every sequence samples its last token.
    """
    query_lens = torch.tensor(step.query_lens, dtype=torch.int64)
    seq_lens = query_lens.clone()
    seq_lens[-1] = step.context_len
    query_start_loc = torch.zeros(len(step.query_lens) + 1, dtype=torch.int64)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    owner = torch.repeat_interleave(torch.arange(len(step.query_lens)), query_lens)
    positions = (seq_lens - query_lens)[owner] + torch.arange(step.num_tokens) - query_start_loc[owner]
    width = -(-step.context_len // block_size)
    return StepInputs(
        input_ids=torch.zeros(step.num_tokens, dtype=torch.int64),
        positions=positions,
        slot_mapping=torch.full((step.num_tokens,), PAD_SLOT, dtype=torch.int64),
        block_tables=torch.zeros(len(step.query_lens), width, dtype=torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        query_start_loc=query_start_loc.to(torch.int32),
        logits_indices=query_start_loc[1:] - 1,
        sampled_rows=list(range(len(step.query_lens))),
    )


def warm_up(runner, steps: list[WarmupStep], block_size: int) -> float:
    """Run every step of `steps` through `runner` (a ModelRunner), decodes on its ladder; the seconds taken."""
    start = time.perf_counter()
    for step in steps:
        runner.execute(runner.prepare(warmup_inputs(step, block_size)))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - start
    logger.info("warmed up %d step shapes (%d decode sizes) in %.1fs", len(steps),
                sum(step.is_decode for step in steps), seconds)
    return seconds
