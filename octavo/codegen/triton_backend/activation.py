"""Triton kernels: octavo.silu_and_mul and octavo.gelu_and_mul (gated MLP activations).

Semantics: x [..., 2 * I] is cat(gate, up); the result [..., I] is
``act(gate) * up`` in x's dtype, with act = silu (``g * sigmoid(g)``) or gelu
(exact erf form, or the tanh approximation when approximate == "tanh").
Computed in float32 and rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from octavo.codegen.triton_backend.availability import rows_per_program

_ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _gated_activation_kernel(
    x_ptr, output_ptr, x_row_stride, output_row_stride, num_rows, intermediate_size,
    ACTIVATION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr,  # noqa: N803
):
    # Grid: (row block, column block); the gate is column c of a row, the up projection column c + I.
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (columns < intermediate_size)[None, :]
    gate_pointers = x_ptr + rows[:, None] * x_row_stride + columns[None, :]
    gate = tl.load(gate_pointers, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_pointers + intermediate_size, mask=mask, other=0.0).to(tl.float32)
    # The activation of the gate, in float32.
    if ACTIVATION == 0:
        activated = gate * tl.sigmoid(gate)
    elif ACTIVATION == 1:
        activated = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        activated = gate * tl.sigmoid(2.0 * inner)
    # Times the up projection, rounded once to the output dtype.
    tl.store(output_ptr + rows[:, None] * output_row_stride + columns[None, :],
             (activated * up).to(output_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: Tensor) -> Tensor:
    """octavo.silu_and_mul: silu(x[..., :I]) * x[..., I:]."""
    return _launch(x, "silu")


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """octavo.gelu_and_mul: gelu(x[..., :I], approximate) * x[..., I:] (approximate "none" or "tanh")."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return _launch(x, "gelu" if approximate == "none" else "gelu_tanh")


def _launch(x: Tensor, activation: str) -> Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"a gated activation needs an even last dim, got {x.shape[-1]}")
    intermediate_size = x.shape[-1] // 2
    output = torch.empty(*x.shape[:-1], intermediate_size, dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    if num_rows == 0 or intermediate_size == 0:
        return output
    block = min(triton.next_power_of_2(intermediate_size), 1024)
    block_r = rows_per_program(block, num_rows)
    _gated_activation_kernel[(triton.cdiv(num_rows, block_r), triton.cdiv(intermediate_size, block))](
        rows, output, rows.stride(0), intermediate_size, num_rows, intermediate_size,
        ACTIVATION=_ACTIVATIONS[activation], BLOCK_R=block_r, BLOCK=block,
    )
    return output
