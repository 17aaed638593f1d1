"""KERNELS of the Triton backend: octavo op overload -> launcher as an ``octavo_triton::`` op (imports Triton)."""

from __future__ import annotations

import importlib

import torch

from octavo.codegen.kernel_ops import kernel_op
from octavo.codegen.triton_backend.op_table import TRITON_OPS


def build_kernel_table() -> dict:
    """op overload -> launcher op, for every op of TRITON_OPS that is registered in this process."""
    import octavo.ir.ops  # noqa: F401  (registers the octavo:: ops)

    table = {}
    for op_name, entry in TRITON_OPS.items():
        packet = getattr(torch.ops.octavo, op_name, None)
        if packet is None:
            continue
        module = importlib.import_module(f"octavo.codegen.triton_backend.{entry.module}")
        launcher = getattr(module, entry.launcher)
        table[packet.default] = kernel_op("octavo_triton", packet.default, launcher)
        if hasattr(launcher, "prepare"):
            PREPARE_HOOKS[packet.default] = launcher.prepare
    return table


PREPARE_HOOKS: dict = {}
"""octavo op -> `prepare(node)` of its launcher, for the launchers that have one (filled with the table)."""
