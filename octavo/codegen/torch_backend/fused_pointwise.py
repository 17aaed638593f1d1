"""Torch (CPU) kernel for octavo.fused_pointwise: the program's ATen ops, one after the other.

Decoding is cached per program text (octavo.ir.ops.fused_pointwise.decode_program),
so a step only pays for the ops themselves. Evaluating the very ops the
partitioner removed keeps the results bit for bit those of the unfused graph.
"""

from __future__ import annotations

from torch import Tensor

from octavo.ir.ops.fused_pointwise import evaluate_program


def fused_pointwise(inputs: list[Tensor], program: str) -> Tensor:
    """Same semantics as octavo.ir.ops.fused_pointwise.fused_pointwise (see its docstring)."""
    return evaluate_program(inputs, program)
