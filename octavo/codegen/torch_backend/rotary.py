"""Torch (CPU) kernel for octavo.rotary_embedding: the reference's op sequence, cos/sin gathered once."""

from __future__ import annotations

import torch
from torch import Tensor


def rotary_embedding(query: Tensor, key: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Same semantics as octavo.ir.ops.rotary.rotary_embedding (see its docstring)."""
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos = cos_sin[:, 0].unsqueeze(0).unsqueeze(0)
    sin = cos_sin[:, 1].unsqueeze(0).unsqueeze(0)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(tensor: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = tensor.shape[-1] // 2
    rotated = torch.cat((-tensor[..., half:], tensor[..., :half]), dim=-1)
    if cos.dtype != tensor.dtype:
        return tensor * cos + rotated * sin
    # With one dtype the products are new tensors of the result's dtype: in place keeps the values.
    return (tensor * cos).add_(rotated.mul_(sin))
