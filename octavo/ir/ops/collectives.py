"""octavo::all_reduce and octavo::all_gather: the collectives of a tensor-parallel program.

A graph holding these ops is the program of one rank of a group of
``world_size`` ranks that all run the same graph on their own weight shards.
The value of an op's input on rank r is written ``x_r``. ``group`` names the
group logically ("tp": the ranks of one tensor-parallel group); the runtime
binds the name to a process group when it lowers the ops to
torch.distributed's functional collectives.

The CPU implementations registered here are the single-process definition:
a group of one rank, where the sum or the concatenation over ranks is the
input itself (returned as a new tensor). For ``world_size > 1`` they raise,
because one process holds only its own ``x_r``; ``all_reduce_reference`` and
``all_gather_reference`` give the results from the list of every rank's
input, which is how tests evaluate a sharded program in one process.
"""

from __future__ import annotations

import torch
from torch import Tensor

from octavo.errors import OctavoError

RUNTIME_LOWERED_OPS = ("all_reduce", "all_gather")
"""The ops of this module. No backend kernel table implements them: the distributed runtime
replaces them by torch.distributed's functional collectives before a backend lowers the graph."""


@torch.library.custom_op("octavo::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group: str, world_size: int) -> Tensor:
    """The sum over the ranks of ``group``: every rank gets ``x_0 + x_1 + ... + x_{world_size-1}``.

    Shapes and dtype: every ``x_r`` has ``x``'s shape and dtype; so does the
    result, which is the same on every rank. The sum is taken in ``x.dtype``;
    the order in which the backend adds the terms is its own (gloo and NCCL
    reduce in chunks), so in floating point the result may differ from the
    left-to-right sum by rounding (for float32 and two ranks it cannot:
    ``a + b == b + a`` exactly). With ``world_size == 1`` the result is ``x``.
    """
    _check_single_process(group, world_size, "all_reduce")
    return x.clone()


@all_reduce.register_fake
def _(x, group, world_size):
    return torch.empty_like(x)


@torch.library.custom_op("octavo::all_gather", mutates_args=())
def all_gather(x: Tensor, group: str, world_size: int, dim: int) -> Tensor:
    """The concatenation over the ranks of ``group`` along ``dim``: ``cat([x_0, ..., x_{world_size-1}], dim)``.

    Shapes: every ``x_r`` has ``x``'s shape and dtype; the result has size
    ``world_size * x.shape[dim]`` along ``dim`` (negative dims count from the
    end) and is the same on every rank. Values are copied, not computed, so
    the result is exact. With ``world_size == 1`` the result is ``x``.
    """
    _check_single_process(group, world_size, "all_gather")
    return x.clone()


@all_gather.register_fake
def _(x, group, world_size, dim):
    shape = list(x.shape)
    shape[dim] = shape[dim] * world_size
    return x.new_empty(shape)


def all_reduce_reference(values: list[Tensor]) -> Tensor:
    """The definition of all_reduce from every rank's input (rank order), summed left to right."""
    total = values[0].clone()
    for value in values[1:]:
        total = total + value
    return total


def all_gather_reference(values: list[Tensor], dim: int) -> Tensor:
    """The definition of all_gather from every rank's input, in rank order."""
    return torch.cat(values, dim=dim)


def _check_single_process(group: str, world_size: int, name: str) -> None:
    if world_size < 1:
        raise OctavoError(f"octavo.{name}: world_size must be >= 1, got {world_size}")
    if world_size > 1:
        raise OctavoError(f"octavo.{name} over {world_size} ranks of group {group!r} runs only in the distributed "
                          "runtime, which lowers it to torch.distributed; one process holds only its own shard")
