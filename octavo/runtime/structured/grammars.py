"""Compiling structured-output specs with xgrammar, once per distinct spec.

xgrammar turns a JSON schema, regex or EBNF grammar into a pushdown automaton over the model's
vocabulary, with the token masks of most states precomputed: compiling a 10-field schema takes a
few tens of milliseconds, after which a mask costs microseconds. `GrammarCache` keeps the compiled
grammars of the last `capacity` distinct specs (least recently used dropped first), so a schema
sent by many requests is compiled once. It is thread-safe: the server compiles on its tokenizer
threads, off the engine thread, and the engine finds the grammar in the cache.

The tokenizer's vocabulary is read once, on first use (a few hundred milliseconds). A server builds
the compiler (`compiler()`) before its engine and tokenizer threads start, so that reading the
vocabulary never runs beside another thread's use of the same tokenizer.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from typing import Any

from octavo.runtime.structured.formats import exact_formats
from octavo.runtime.structured.spec import GrammarError, StructuredOutputs
from octavo.runtime.structured.spelling import Spelling

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 256
"""Compiled grammars kept (each holds its precomputed masks: tens of KiB to a few MiB)."""

MAX_JSON_WHITESPACE = 16
"""Most whitespace characters one gap of JSON may hold: enough for any indentation a model writes, few
enough that a model stuck on newlines cannot fill its whole budget with them."""

_CPP_LOCATION = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")


def xgrammar_message(error: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix, on one line."""
    return " ".join(_CPP_LOCATION.sub("", str(error)).split())


class GrammarCache:
    """Compiles specs for one vocabulary (`tokenizer`, `vocab_size`, stop tokens) and keeps the results."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 capacity: int = DEFAULT_CAPACITY):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.capacity = capacity
        self.compilations = 0
        self.hits = 0
        self._compiler = None
        self._spelling: Spelling | None = None
        self._grammars: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()

    def compiler(self):
        """The xgrammar GrammarCompiler of this vocabulary (built on first use)."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._spelling = Spelling(info.decoded_vocab, info.special_token_ids)
                self._tokenizer = None
            return self._compiler

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar of `spec` (cached); GrammarError when xgrammar rejects it."""
        with self._lock:
            grammar = self._grammars.get(spec.key)
            if grammar is not None:
                self._grammars.move_to_end(spec.key)
                self.hits += 1
                return grammar
        # Compiled outside the lock: two threads may compile one new spec at once (both results are equal),
        # but a long compile never holds up lookups of other specs.
        grammar = self._compile(spec)
        with self._lock:
            self.compilations += 1
            self._grammars[spec.key] = grammar
            while len(self._grammars) > self.capacity:
                self._grammars.popitem(last=False)
        return grammar

    def _compile(self, spec: StructuredOutputs):
        compiler = self.compiler()
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                return compiler.compile_json_schema(exact_formats(spec.schema_text()),
                                                    any_whitespace=not spec.disable_any_whitespace,
                                                    max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                self._check_spelled(spec.choice)
                return compiler.compile_grammar(spec.choice_grammar())
            return compiler.compile_grammar(spec.grammar)
        except RuntimeError as error:  # xgrammar reports every rejection so
            raise GrammarError(kind, f"the grammar engine rejected the {_describe(kind)}: "
                                     f"{xgrammar_message(error)}") from None

    def _check_spelled(self, choices: list[str]) -> None:
        """GrammarError naming the first choice no sequence of the vocabulary's tokens writes."""
        for index, choice in enumerate(choices):
            position = self._spelling.first_unwritable(choice)
            if position is not None:
                raise GrammarError("choice", f"choice {index} ({choice!r}) cannot be written with the model's "
                                             f"vocabulary: no tokens spell its character {position} "
                                             f"({choice[position]!r}) there")


def _describe(kind: str) -> str:
    return {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
            "choice": "choices", "grammar": "EBNF grammar"}[kind]
