"""Deciding whether a sequence is finished after each new token, with vLLM's rules and order.

:func:`check_stop` is called after a token was appended to the output and detokenized. In order:

1. while ``len(output) < min_tokens`` only the length limits (steps 5 and 6) can finish it;
2. the last token is an EOS id (unless ``ignore_eos``): ``"stop"``, ``stop_reason`` None;
3. the last token is in ``stop_token_ids``: ``"stop"``, ``stop_reason`` = that id;
4. a stop string occurs in the text that could hold a new match: ``"stop"``, ``stop_reason`` = the
   string, the text cut before it (after it with ``include_stop_str_in_output``; text after it is
   always dropped). When several stop strings occur, the earliest occurrence wins;
5. ``len(output) >= max_tokens``: ``"length"``;
6. ``num_total_tokens >= max_model_len``: ``"length"``.

As in vLLM, a finishing EOS or stop token's own text is removed from the output (``truncate_text_to``
drops the delta it added) unless ``include_stop_str_in_output``; with ``skip_special_tokens`` a
special EOS token adds no text anyway.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from octavo.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopDecision:
    """Whether and why a sequence finished; ``truncate_text_to`` is the new ``len(output_text)``."""

    finished: bool
    finish_reason: str | None  # "stop" | "length" | None
    stop_reason: int | str | None  # the stop token id or stop string that ended it (None: EOS, length)
    truncate_text_to: int | None  # new len(output_text) when text must be cut off, else None


NOT_FINISHED = StopDecision(finished=False, finish_reason=None, stop_reason=None, truncate_text_to=None)


def check_stop(
    params: SamplingParams,
    eos_token_ids: Collection[int],
    output_token_ids: Sequence[int],
    output_text: str,
    new_text_len: int,
    num_total_tokens: int,
    max_model_len: int,
) -> StopDecision:
    """Decide whether the sequence is finished after its last token; see the module docstring.

    ``new_text_len`` is the length of the text delta the last token(s) added to ``output_text``;
    ``num_total_tokens`` counts prompt and output tokens.
    """
    if output_token_ids and len(output_token_ids) >= params.min_tokens:
        decision = _check_stop_tokens(params, eos_token_ids, output_token_ids[-1], output_text, new_text_len)
        if decision is None:
            decision = _check_stop_strings(params, output_text, new_text_len)
        if decision is not None:
            return decision
    if params.max_tokens is not None and len(output_token_ids) >= params.max_tokens:
        return StopDecision(True, "length", None, None)
    if num_total_tokens >= max_model_len:
        return StopDecision(True, "length", None, None)
    return NOT_FINISHED


def held_back_length(params: SamplingParams) -> int:
    """Trailing characters a streaming client must not be sent yet: they may start a stop string.

    ``longest stop string - 1``; 0 without stop strings or with ``include_stop_str_in_output``
    (then a stop string is sent anyway). Once the sequence finishes, everything left is sent.
    """
    if params.include_stop_str_in_output or not params.stop:
        return 0
    return params.max_stop_string_length - 1


def _check_stop_tokens(
    params: SamplingParams,
    eos_token_ids: Collection[int],
    last_token_id: int,
    output_text: str,
    new_text_len: int,
) -> StopDecision | None:
    if not params.ignore_eos and last_token_id in eos_token_ids:
        stop_reason = None
    elif last_token_id in params.stop_token_ids:
        stop_reason = last_token_id
    else:
        return None
    truncate_to = None
    if new_text_len and not params.include_stop_str_in_output:
        # The stop token's own text is not part of the output (vLLM drops it too).
        truncate_to = len(output_text) - new_text_len
    return StopDecision(True, "stop", stop_reason, truncate_to)


def _check_stop_strings(params: SamplingParams, output_text: str, new_text_len: int) -> StopDecision | None:
    if not new_text_len or not params.stop:
        return None
    best_start: int | None = None
    best_stop: str = ""
    for stop_string in params.stop:
        # Only a match that overlaps the new text is new; earlier text was searched before.
        search_from = max(0, len(output_text) - new_text_len - len(stop_string) + 1)
        start = output_text.find(stop_string, search_from)
        if start != -1 and (best_start is None or start < best_start):
            best_start, best_stop = start, stop_string
    if best_start is None:
        return None
    end = best_start + len(best_stop) if params.include_stop_str_in_output else best_start
    truncate_to = end if end < len(output_text) else None
    return StopDecision(True, "stop", best_stop, truncate_to)
