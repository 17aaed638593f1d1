"""Structured output: constraining what a request generates to a JSON schema, regex, choice or grammar.

`spec` (what is asked), `grammars` (compiled once per spec, by xgrammar), `matcher` (a sequence's
position in its grammar), `masks` (each step's banned tokens, computed while the model runs) and
`manager` (the engine's part). Only the spec is imported here: SamplingParams needs it, and the
rest imports the runtime's scheduler, which imports SamplingParams.
"""

from octavo.runtime.structured.spec import GrammarError, StructuredOutputs

__all__ = ["GrammarError", "StructuredOutputs"]
