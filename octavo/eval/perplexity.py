"""Perplexity of an artifact on a text, with a fixed window and stride, through the engine.

The text is tokenized once without special tokens (the same ids for every artifact of one
model, whatever its dtype or quantization). Windows start at 0, stride, 2 * stride, ...
and hold up to ``window`` tokens; each window scores only the tokens no earlier window
scored (its last ``end - previous_end`` positions), with the rest of the window as
context, so every token but the very first (nothing predicts it) is scored exactly once:
the first window scores ``window - 1`` tokens, each later one ``stride`` (the last, fewer).
The windows stop at the first that reaches the end of the text.

Each window is one engine request with ``prompt_logprobs=0`` (the log probability of
every prompt token under the model, from the raw logits, see Sampler.prompt_logprobs) and
one generated token that is ignored; the engine batches the windows like any requests.
``perplexity = exp(-sum(scored logprobs) / tokens_scored)``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from octavo.errors import OctavoError
from octavo.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from octavo.runtime.engine import LLMEngine

DEFAULT_WINDOW = 512
DEFAULT_STRIDE = 256


@dataclass(frozen=True)
class Window:
    start: int
    end: int
    scored: int  # the last `scored` tokens of tokens[start:end] are scored


@dataclass
class PerplexityResult:
    perplexity: float
    negative_log_likelihood: float
    tokens_scored: int
    windows: int
    window: int
    stride: int
    tokens_sha256: str

    def as_dict(self) -> dict:
        return asdict(self)


def plan_windows(num_tokens: int, window: int = DEFAULT_WINDOW, stride: int = DEFAULT_STRIDE) -> list[Window]:
    """The windows over `num_tokens` tokens (see the module docstring)."""
    if window < 2 or not 1 <= stride <= window:
        raise OctavoError(f"need window >= 2 and 1 <= stride <= window, got window {window}, stride {stride}")
    if num_tokens < 2:
        raise OctavoError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    windows, previous_end = [], 1  # token 0 is never scored
    for start in range(0, num_tokens, stride):
        end = min(start + window, num_tokens)
        windows.append(Window(start, end, end - previous_end))
        previous_end = end
        if end == num_tokens:
            break
    return windows


def tokenize_text(tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """The text's token ids without special tokens, cut to `max_tokens` when given."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return ids[:max_tokens] if max_tokens else ids


def perplexity(engine: LLMEngine, token_ids: list[int], window: int = DEFAULT_WINDOW, stride: int = DEFAULT_STRIDE,
               on_window: Callable[[int], None] | None = None) -> PerplexityResult:
    """Score `token_ids` with the engine's artifact; `on_window(tokens)` is called as each window finishes."""
    windows = plan_windows(len(token_ids), window, stride)
    if window >= engine.max_model_len:
        raise OctavoError(f"window {window} does not fit the engine's max_model_len {engine.max_model_len}: a window "
                          f"is a prompt the engine generates one token after, so it takes at most "
                          f"{engine.max_model_len - 1} tokens")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    pending = {}
    for index, item in enumerate(windows):
        request = engine.add_request(token_ids[item.start:item.end], params, request_id=f"perplexity-{index}")
        pending[request.request_id] = item
    total = 0.0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if not output.finished:
                continue
            item = pending.pop(output.request_id)
            if output.error or output.prompt_logprobs is None:
                raise OctavoError(f"scoring window {output.request_id} failed: {output.error}")
            scored = output.prompt_logprobs[len(output.prompt_logprobs) - item.scored:]
            chosen = token_ids[item.end - item.scored:item.end]
            total += sum(entry[token].logprob for entry, token in zip(scored, chosen, strict=True))
            if on_window:
                on_window(item.scored)
    tokens_scored = sum(item.scored for item in windows)
    digest = hashlib.sha256(str(token_ids).encode()).hexdigest()
    return PerplexityResult(math.exp(-total / tokens_scored), -total, tokens_scored, len(windows), window, stride,
                            digest)
