"""Log probabilities in the two OpenAI response shapes (completions' and chat's).

The engine gives, per generated token, a dict token id -> Logprob holding the sampled token and the
`logprobs` most likely tokens, each with its rank (1 = most likely) under the raw model distribution.
JSON has no infinities, so a logprob of -inf is written as -9999.0 (as vLLM does).
"""

from __future__ import annotations

import math

from octavo.runtime.outputs import Logprob

NEGATIVE_INFINITY_STANDIN = -9999.0


def finite(value: float) -> float:
    return value if math.isfinite(value) else NEGATIVE_INFINITY_STANDIN


def top_entries(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The `num_top` most likely tokens of one position, most likely first."""
    ranked = sorted(entry.items(), key=lambda item: (item[1].rank if item[1].rank is not None else math.inf,
                                                     -item[1].logprob))
    return ranked[:num_top]


def completion_logprobs(entries: list[dict[int, Logprob] | None], token_ids: list[int], num_top: int,
                        text_offset: int, unscored_text: str = "") -> tuple[dict, int]:
    """The completions `logprobs` object for these tokens, and the text offset after them.

    `top_logprobs[i]` maps token text -> logprob for the `num_top` most likely tokens and the sampled
    one (as vLLM answers, so `logprobs: 0` still shows the sampled token). An entry of None is a
    token nothing scored (an echoed prompt's first token): its text is `unscored_text`, and its
    logprob and top_logprobs are null, as OpenAI answers.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            tokens.append(unscored_text)
            token_logprobs.append(None)
            top_logprobs.append(None)
            offsets.append(text_offset)
            text_offset += len(unscored_text)
            continue
        chosen = entry[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(finite(chosen.logprob))
        alternatives = {(item.decoded_token or ""): finite(item.logprob) for _, item in top_entries(entry, num_top)}
        alternatives.setdefault(text, finite(chosen.logprob))
        top_logprobs.append(alternatives)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}, text_offset


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], num_top: int) -> list[dict]:
    """The chat `logprobs.content` list for these tokens: each with its `num_top` alternatives."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        chosen = entry[token_id]
        item = _chat_token(chosen)
        item["top_logprobs"] = [_chat_token(alternative) for _, alternative in top_entries(entry, num_top)]
        content.append(item)
    return content


def _chat_token(logprob: Logprob) -> dict:
    text = logprob.decoded_token or ""
    return {"token": text, "logprob": finite(logprob.logprob), "bytes": list(text.encode("utf-8"))}
