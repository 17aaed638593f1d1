"""Per-request sampling parameters, with vLLM's fields, defaults and validation rules.

Semantics follow vLLM's ``SamplingParams`` (which follows the OpenAI completions API):

- ``n``: number of output sequences for the prompt (>= 1; must be 1 for greedy sampling).
- ``presence_penalty`` / ``frequency_penalty`` in [-2, 2]: subtracted from a token's logit once if
  it occurs in the generated output / once per occurrence in the generated output.
- ``repetition_penalty`` > 0 (1 = off): HF/CTRL penalty for tokens in the prompt or the output.
- ``temperature`` >= 0: 0 (below 1e-5) means greedy; values in (0, 0.01) are raised to 0.01, as vLLM
  does, because smaller ones overflow float32 when dividing logits.
- ``top_p`` in (0, 1], ``top_k`` (0 or -1 = off, else >= 1; -1 is stored as 0), ``min_p`` in [0, 1].
- ``seed``: per-request seed (-1 is stored as None, meaning unseeded).
- ``stop``: strings that end generation (normalized to ``list[str]``, none empty);
  ``stop_token_ids``: token ids that end generation (normalized to ``list[int]``).
- ``include_stop_str_in_output``, ``ignore_eos``.
- ``max_tokens`` >= 1 or None (= up to the model length); ``min_tokens`` in [0, max_tokens].
- ``logprobs`` / ``prompt_logprobs``: number of top log probabilities per token (>= 0; True = 1).
- ``skip_special_tokens``, ``spaces_between_special_tokens``: detokenization options.
- ``logit_bias``: token id -> bias added to the logit; keys may be ints or decimal strings (JSON),
  values are clamped to [-100, 100] as the OpenAI API specifies.
- ``speculative``: False opts this request out of speculative decoding (when the engine has it on);
  speculation never changes what is sampled, only how fast.
- ``structured``: a :class:`~octavo.runtime.structured.StructuredOutputs` (or a dict of its fields):
  the output must match a JSON schema, any JSON object, a regex, one of some strings or an EBNF
  grammar; tokens the grammar does not allow next are never sampled (see ``octavo.runtime.structured``).

Invalid values raise :class:`octavo.errors.RequestError` with a one-line message naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from octavo.errors import RequestError
from octavo.runtime.structured.spec import StructuredOutputs

logger = logging.getLogger(__name__)

GREEDY_TEMPERATURE_EPSILON = 1e-5
"""Temperatures below this mean greedy sampling (vLLM's _SAMPLING_EPS)."""

MINIMUM_RANDOM_TEMPERATURE = 1e-2
"""Positive temperatures below this are raised to it (vLLM's _MAX_TEMP)."""

LOGIT_BIAS_LIMIT = 100.0


def _fail(field_name: str, requirement: str, value: Any) -> RequestError:
    return RequestError(f"SamplingParams.{field_name} must be {requirement}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_real_in_range(
    field_name: str, value: Any, low: float, high: float, low_open: bool = False
) -> None:
    """Raise unless ``value`` is a finite real number in [low, high] (or (low, high])."""
    bracket = "(" if low_open else "["
    requirement = f"a number in {bracket}{low:g}, {high:g}]"
    if not _is_real(value) or not math.isfinite(value):
        raise _fail(field_name, requirement, value)
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        raise _fail(field_name, requirement, value)


def _check_optional_count(field_name: str, value: Any, minimum: int) -> None:
    if value is not None and (not _is_int(value) or value < minimum):
        raise _fail(field_name, f"None or an integer >= {minimum}", value)


def _check_bool(field_name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _fail(field_name, "a bool", value)


@dataclass
class SamplingParams:
    """Sampling parameters of one request; see the module docstring for each field's meaning."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    speculative: bool = True
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        self.structured = StructuredOutputs.of(self.structured)
        self._normalize()
        self._verify_counts()
        self._verify_penalties()
        self._verify_sampling()
        self._verify_stops()
        self._verify_flags()
        if self.is_greedy:
            # Greedy decoding ignores the truncation knobs; reset them so the sampler never applies them.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise _fail("n", "1 when sampling greedily (temperature 0)", self.n)

    # ----- normalization (same as vLLM: -1 seed/top_k mean off, True logprobs mean 1) -----

    def _normalize(self) -> None:
        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, list | tuple):
            self.stop = list(self.stop)
        else:
            raise _fail("stop", "None, a string or a list of strings", self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise _fail("stop_token_ids", "None or a list of token ids", self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = self._normalized_logit_bias(self.logit_bias)
        if _is_real(self.temperature) and 0 < self.temperature < MINIMUM_RANDOM_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s, which overflows float32 logits; using %s",
                self.temperature, MINIMUM_RANDOM_TEMPERATURE, MINIMUM_RANDOM_TEMPERATURE,
            )
            self.temperature = MINIMUM_RANDOM_TEMPERATURE

    @staticmethod
    def _normalized_logit_bias(logit_bias: Any) -> dict[int, float]:
        if not isinstance(logit_bias, dict):
            raise _fail("logit_bias", "a dict of token id -> bias", logit_bias)
        normalized: dict[int, float] = {}
        for token, bias in logit_bias.items():
            try:
                token_id = int(token)
            except (TypeError, ValueError):
                raise _fail("logit_bias", "keyed by integer token ids", token) from None
            if isinstance(token, bool) or token_id < 0:
                raise _fail("logit_bias", "keyed by non-negative token ids", token)
            if not _is_real(bias) or math.isnan(bias):
                raise _fail("logit_bias", "valued by numbers", bias)
            normalized[token_id] = float(min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, bias)))
        return normalized

    # ----- verification, one group of fields per method -----

    def _verify_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise _fail("n", "an integer >= 1", self.n)
        _check_optional_count("max_tokens", self.max_tokens, 1)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _fail("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", f"<= max_tokens={self.max_tokens}", self.min_tokens)
        _check_optional_count("logprobs", self.logprobs, 0)
        _check_optional_count("prompt_logprobs", self.prompt_logprobs, 0)
        if self.seed is not None and not _is_int(self.seed):
            raise _fail("seed", "None or an integer", self.seed)

    def _verify_penalties(self) -> None:
        _check_real_in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_real_in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not _is_real(self.repetition_penalty) or not math.isfinite(self.repetition_penalty):
            raise _fail("repetition_penalty", "a finite number > 0", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise _fail("repetition_penalty", "a finite number > 0", self.repetition_penalty)

    def _verify_sampling(self) -> None:
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise _fail("temperature", "a finite number >= 0", self.temperature)
        _check_real_in_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _fail("top_k", "0 or -1 (disabled) or an integer >= 1", self.top_k)
        _check_real_in_range("min_p", self.min_p, 0.0, 1.0)

    def _verify_stops(self) -> None:
        for stop_string in self.stop:
            if not isinstance(stop_string, str) or not stop_string:
                raise _fail("stop", "a list of non-empty strings", self.stop)
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise _fail("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)

    def _verify_flags(self) -> None:
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "speculative",
        ):
            _check_bool(name, getattr(self, name))

    # ----- derived values -----

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax of the processed logits (temperature < 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE_EPSILON

    @property
    def max_stop_string_length(self) -> int:
        """Length in characters of the longest stop string, 0 when there is none."""
        return max((len(stop_string) for stop_string in self.stop), default=0)

    def verify_token_ids(self, vocab_size: int) -> None:
        """Raise RequestError if ``logit_bias`` or ``stop_token_ids`` name a token id >= ``vocab_size``.

        Not called by ``__post_init__`` (the vocabulary is not known there); the engine calls it
        when a request arrives, as vLLM's input processor does.
        """
        for token_id in self.logit_bias or {}:
            if token_id >= vocab_size:
                raise _fail("logit_bias", f"keyed by token ids < vocab size {vocab_size}", token_id)
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise _fail("stop_token_ids", f"token ids < vocab size {vocab_size}", token_id)

    def clone(self, **changes: Any) -> SamplingParams:
        """Return a deep copy with ``changes`` applied; the result is validated again."""
        return dataclasses.replace(copy.deepcopy(self), **changes)
