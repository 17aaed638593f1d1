"""octavo::rotary_embedding: rotate_half (GPT-NeoX style) RoPE on query and key from a cos/sin cache."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("octavo::rotary_embedding", mutates_args=())
def rotary_embedding(query: Tensor, key: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of query and key, each token at its own position.

    Shapes: ``query`` [1, Hq, T, D] and ``key`` [1, Hkv, T, D] (the layout in
    which transformers applies RoPE, after the head transpose; any strides),
    ``positions`` int64 [T], ``cos_sin_cache`` [max_positions, 2, D] holding
    ``cos`` at ``[p, 0]`` and ``sin`` at ``[p, 1]`` for position ``p``, already
    in the model dtype (the compiler fills it by evaluating the model's own
    rotary subgraph, scaling and final cast included).

    With ``cos = cos_sin_cache[positions, 0]`` and ``sin = cos_sin_cache[positions, 1]``
    broadcast over heads ([1, 1, T, D]) and
    ``rotate_half(t) = cat(-t[..., D/2:], t[..., :D/2], dim=-1)``, returns
    ``(query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin)``,
    each op in the dtype torch's type promotion gives (the model dtype), exactly
    as transformers' apply_rotary_pos_emb computes it. Positions must lie in
    ``[0, max_positions)``.
    """
    return rotary_embedding_reference(query, key, positions, cos_sin_cache)


@rotary_embedding.register_fake
def _(query, key, positions, cos_sin_cache):
    return (torch.empty_like(query, dtype=torch.promote_types(query.dtype, cos_sin_cache.dtype)),
            torch.empty_like(key, dtype=torch.promote_types(key.dtype, cos_sin_cache.dtype)))


def rotate_half(tensor: Tensor) -> Tensor:
    """cat(-second half, first half) along the last dim (transformers' rotate_half)."""
    half = tensor.shape[-1] // 2
    return torch.cat((-tensor[..., half:], tensor[..., :half]), dim=-1)


def rotary_embedding_reference(query: Tensor, key: Tensor, positions: Tensor,
                               cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """The definition (transformers' apply_rotary_pos_emb with unsqueeze_dim=1, op for op)."""
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos = cos_sin[:, 0].unsqueeze(0).unsqueeze(0)
    sin = cos_sin[:, 1].unsqueeze(0).unsqueeze(0)
    query_out = query * cos + rotate_half(query) * sin
    key_out = key * cos + rotate_half(key) * sin
    return query_out, key_out
