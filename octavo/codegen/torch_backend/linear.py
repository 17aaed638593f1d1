"""Torch kernel for octavo.linear_w16: float32 matmuls over the 16-bit weight, widened one tile of rows at a time.

Widening the whole weight on every call would read the 16-bit weight, write a float32 copy twice its
size and read that copy again: more bytes than the float32 weight itself, where 16-bit storage is meant
to halve them. This kernel widens TILE_BYTES of float32 rows at a time (sized for a core's L2, so each
copy is still in cache when the matmul that reads it runs) and computes those output columns: memory is
read once, in 16 bits. Each output element is aten.linear's float32 sum over the same products (the
widening is exact), only in an order the BLAS picks for the tile, which the op leaves unspecified.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

TILE_BYTES = 1 << 20
"""Bytes of one widened tile of weight rows (float32)."""


def rows_per_tile(in_features: int) -> int:
    return max(1, TILE_BYTES // (4 * max(1, in_features)))


def linear_w16(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Same semantics as octavo.ir.ops.linear.linear_w16; see the module docstring."""
    out_features, in_features = weight.shape
    step = rows_per_tile(in_features)
    if out_features <= step:
        return F.linear(input, weight.float(), bias)
    flat = input.reshape(-1, in_features)
    output = torch.empty((flat.shape[0], out_features), dtype=torch.float32, device=input.device)
    for start in range(0, out_features, step):
        stop = min(out_features, start + step)
        output[:, start:stop] = F.linear(flat, weight[start:stop].float(), None if bias is None else bias[start:stop])
    return output.reshape(*input.shape[:-1], out_features)
