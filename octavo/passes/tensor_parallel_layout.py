"""Which heads, columns and vocabulary rows one tensor-parallel rank owns, and its weight slices.

Weights are sliced from the tensors the context holds (at load time, views
into the memory-mapped artifact): a slice of whole rows stays a view, so a
rank reads only the pages of its own shard; row sets that are concatenated
(q, k and v heads; gate and up halves) or column slices are copied, and then
only the rank's share is ever materialized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.errors import PassError


@dataclass(frozen=True)
class HeadShard:
    """The query and KV heads of one rank (ranges of head indices)."""

    q_heads: range
    kv_heads: range
    head_dim: int


def head_shard(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, tp_rank: int) -> HeadShard:
    """Rank `tp_rank` owns query heads [r * Hq / tp, (r + 1) * Hq / tp) and the KV heads they read.

    Query head h reads KV head h // (Hq / Hkv). With tp <= Hkv each rank owns
    Hkv / tp KV heads; with tp > Hkv each KV head is replicated on tp / Hkv
    ranks (as vLLM does), so every rank owns exactly one. Sizes that do not
    divide are a PassError naming them.
    """
    if num_heads % tp_size:
        raise PassError(f"tensor parallel size {tp_size} does not divide the {num_heads} attention heads")
    if num_heads % num_kv_heads:
        raise PassError(f"{num_heads} attention heads are not a multiple of the {num_kv_heads} KV heads")
    if tp_size <= num_kv_heads and num_kv_heads % tp_size:
        raise PassError(f"tensor parallel size {tp_size} does not divide the {num_kv_heads} KV heads")
    if tp_size > num_kv_heads and tp_size % num_kv_heads:
        raise PassError(f"tensor parallel size {tp_size} exceeds the {num_kv_heads} KV heads and is not a multiple "
                        "of them: KV heads can be replicated only over a whole number of ranks each")
    q_per_rank = num_heads // tp_size
    q_heads = range(tp_rank * q_per_rank, (tp_rank + 1) * q_per_rank)
    if tp_size <= num_kv_heads:
        kv_per_rank = num_kv_heads // tp_size
        kv_heads = range(tp_rank * kv_per_rank, (tp_rank + 1) * kv_per_rank)
    else:
        kv_head = tp_rank // (tp_size // num_kv_heads)
        kv_heads = range(kv_head, kv_head + 1)
    return HeadShard(q_heads, kv_heads, head_dim)


def even_share(size: int, tp_size: int, tp_rank: int, what: str) -> range:
    """[r * size / tp, (r + 1) * size / tp): a dimension that must divide evenly (MLP intermediate size)."""
    if size % tp_size:
        raise PassError(f"tensor parallel size {tp_size} does not divide the {what} of {size}")
    share = size // tp_size
    return range(tp_rank * share, (tp_rank + 1) * share)


@dataclass(frozen=True)
class VocabShard:
    """Rows [start, start + size) of a vocabulary of `vocab_size`, padded with zero rows past the end."""

    start: int
    size: int
    vocab_size: int


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> VocabShard:
    """Each rank owns ceil(V / tp) rows; the last rank's share is padded when tp does not divide V."""
    size = -(-vocab_size // tp_size)
    return VocabShard(tp_rank * size, size, vocab_size)


def row_ranges(tensor: torch.Tensor, ranges: list[range]) -> torch.Tensor:
    """The rows of `ranges` in order: a view for a single range, else one concatenated copy."""
    parts = [tensor.narrow(0, part.start, len(part)) for part in ranges if len(part)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def column_range(tensor: torch.Tensor, columns: range) -> torch.Tensor:
    """Columns [start, stop) of a 2-D weight, copied contiguous (a linear reads its rows whole)."""
    return tensor.narrow(1, columns.start, len(columns)).contiguous()


def vocab_rows(tensor: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The shard's rows; the rows past the vocabulary (last rank, uneven split) are zeros."""
    available = max(0, min(shard.size, shard.vocab_size - shard.start))
    rows = tensor.narrow(0, shard.start, available)
    if available == shard.size:
        return rows
    padding = tensor.new_zeros((shard.size - available, *tensor.shape[1:]))
    return torch.cat([rows, padding], dim=0)


def head_rows(heads: range, head_dim: int, offset: int = 0) -> range:
    """The output rows of a projection that produce `heads` (each head_dim rows), from row `offset`."""
    return range(offset + heads.start * head_dim, offset + heads.stop * head_dim)
