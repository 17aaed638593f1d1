"""KERNELS of the Triton backend: octavo op overload -> launcher (imports Triton)."""

from __future__ import annotations

import importlib

import torch

from octavo.codegen.triton_backend.op_table import TRITON_OPS


def build_kernel_table() -> dict:
    """op overload -> launcher, for every op of TRITON_OPS that is registered in this process."""
    import octavo.ir.ops  # noqa: F401  (registers the octavo:: ops)

    table = {}
    for op_name, entry in TRITON_OPS.items():
        packet = getattr(torch.ops.octavo, op_name, None)
        if packet is None:
            continue
        module = importlib.import_module(f"octavo.codegen.triton_backend.{entry.module}")
        table[packet.default] = getattr(module, entry.launcher)
    return table
