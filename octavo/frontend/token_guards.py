"""Checking that an exported program holds for every token count.

The traced program must run for any number of flattened tokens T >= 2 (the
runtime feeds whole steps of any size). torch.export records the conditions
its tracing relied on as guards on the inputs' sizes. Export is asked for a
DYNAMIC token dimension, which records those guards instead of failing on the
ones torch cannot prove, so every guard is checked here: it must hold for
every T in a sweep that covers the small sizes one by one and the large ones
around each power of two (guards on sizes are sums, products, min/max,
floor divisions and remainders of T with small constants, which such a sweep
exposes), and the token dimension must stay symbolic over [2, inf).
"""

from __future__ import annotations

import functools
from types import CodeType

import torch

from octavo.errors import OctavoError
from octavo.ir.graph_inputs import TOKEN_INPUTS

MIN_NUM_TOKENS = 2
_LARGEST_CHECKED = 1 << 24


def token_counts() -> list[int]:
    """The token counts each guard is evaluated at: 2..1024, then 2^k - 1, 2^k, 2^k + 1 up to 2^24."""
    counts = set(range(MIN_NUM_TOKENS, 1025))
    power = 1024
    while power <= _LARGEST_CHECKED:
        counts.update((power - 1, power, power + 1, 3 * power // 2))
        power *= 2
    return sorted(counts)


class _TokenInput:
    """What a guard sees of a [T] token input: its size, stride and storage offset."""

    def __init__(self, num_tokens: int):
        self._num_tokens = num_tokens

    def size(self) -> tuple[int]:
        return (self._num_tokens,)

    def stride(self) -> tuple[int]:
        return (1,)

    def storage_offset(self) -> int:
        return 0


def guard_holds(guard: str, num_tokens: int) -> bool:
    """Evaluate one of torch.export's Python guard expressions with every token input of length `num_tokens`."""
    inputs = {name: _TokenInput(num_tokens) for name in TOKEN_INPUTS}
    namespace = {"__builtins__": {}, "L": inputs, "min": min, "max": max, "abs": abs}
    return bool(eval(_compiled(guard), namespace))


@functools.lru_cache(maxsize=64)
def _compiled(guard: str) -> CodeType:
    # The expression is one torch generated from Octavo's own trace, never from an artifact or a user.
    return compile(guard, "<torch.export guard>", "eval")


def check_token_dimension(program: torch.export.ExportedProgram, model_type: str) -> None:
    """Raise OctavoError unless `program` is valid for every token count (see the module docstring)."""
    placeholder = next(node for node in program.graph.nodes
                       if node.op == "placeholder" and node.name == TOKEN_INPUTS[0])
    size = placeholder.meta["val"].shape[0]
    if not isinstance(size, torch.SymInt):
        raise OctavoError(f"torch.export specialized model_type {model_type!r} to {size} tokens")
    symbol = size.node.expr
    bounds = program.range_constraints.get(symbol)
    if bounds is not None and (bounds.lower > MIN_NUM_TOKENS or bounds.upper < _LARGEST_CHECKED):
        raise OctavoError(f"torch.export limited model_type {model_type!r} to token counts in "
                          f"[{bounds.lower}, {bounds.upper}]")
    for guard in getattr(program, "_guards_code", ()):
        try:
            failing = next((count for count in token_counts() if not guard_holds(guard, count)), None)
        except Exception as error:
            raise OctavoError(f"cannot check torch.export's guard {guard!r} for model_type {model_type!r}: "
                              f"{error}") from error
        if failing is not None:
            raise OctavoError(f"the program torch.export traced for model_type {model_type!r} is valid only "
                              f"where {guard} (not for {failing} tokens)")
