"""octavo::lora: a linear's output plus the low-rank update of each token's LoRA adapter (multi-tenant batches).

The runtime holds every adapter the engine serves in `S` slots of two stacked tensors per targeted linear,
and tells each token which slot its sequence uses; tokens of one batch may use different adapters (or
none). A linear whose output concatenates several projections (fuse_qkv, fuse_gate_up) stacks each
projection's factors block-diagonally: rows r*P..r*P+r_p of `lora_a` and columns of `lora_b` belong to
projection p, zeros elsewhere, so one op serves the fused linear.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("octavo::lora", mutates_args=())
def lora(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, token_slots: Tensor) -> Tensor:
    """``y`` plus each token's adapter update.

    Shapes: ``x`` [..., K] (the linear's input), ``y`` [..., N] (its output; the same leading dims, T
    tokens in all), ``lora_a`` [S, R, K], ``lora_b`` [S, N, R] (the adapter's scale, alpha / r, folded
    into it), ``token_slots`` int64 [T]: the slot of token t's adapter, -1 for none. For token t with
    slot s >= 0: ``out[t] = y[t] + lora_b[s] @ (lora_a[s] @ x[t])``, computed in float32 and rounded
    once to ``y.dtype``; a token with slot -1 gets ``y[t]`` unchanged. Returns a new tensor shaped
    like ``y``.
    """
    return lora_reference(y, x, lora_a, lora_b, token_slots)


@lora.register_fake
def _(y, x, lora_a, lora_b, token_slots):
    return torch.empty_like(y)


def lora_reference(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, token_slots: Tensor) -> Tensor:
    """The definition, segmented: one pair of GEMMs per adapter present in the batch, over its tokens."""
    rows_x = x.reshape(-1, x.shape[-1])
    out = y.reshape(-1, y.shape[-1]).to(torch.float32, copy=True)
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().view(-1)
        shrunk = rows_x.index_select(0, rows).float() @ lora_a[slot].float().t()
        out.index_add_(0, rows, shrunk @ lora_b[slot].float().t())
    return out.to(y.dtype).view(y.shape)
