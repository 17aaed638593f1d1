"""The collectives a rank's program calls: octavo_rank::all_reduce / all_gather on a group bound by logical name.

The parallel passes write ``octavo::all_reduce(x, "tp", n)``; the runtime
rewrites each into ``octavo_rank::all_reduce(x, "tp")`` (see
collectives.lower_collectives), an opaque op whose kernel looks the logical
name up in this process's bindings and calls torch.distributed on the bound
process group. So a compiled (AOTInductor) rank program holds the logical
name only: the process group's own name, which depends on how many groups a
process created before, is never part of the compiled code, and the same
package runs in every launch of the same rank.

A group whose ranks share a host may also be bound to a shared-memory group
(see shm_groups): its CPU all_reduce and all_gather then go through that.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from octavo.errors import OctavoError
from octavo.runtime.distributed.shm_groups import REDUCIBLE_DTYPES, SharedMemoryGroup

_BOUND: dict[str, dist.ProcessGroup] = {}
_SHARED: dict[str, SharedMemoryGroup] = {}


def bind_groups(groups: dict[str, dist.ProcessGroup], shared: dict[str, SharedMemoryGroup] | None = None) -> None:
    """Bind logical group names ("tp") to this process's process groups, for the ops below, and those
    named in `shared` also to their shared-memory group (used for CPU tensors)."""
    _BOUND.update(groups)
    _SHARED.update(shared or {})


def unbind_groups() -> None:
    _BOUND.clear()
    for group in _SHARED.values():
        group.close()
    _SHARED.clear()


def bound_group(name: str) -> dist.ProcessGroup:
    if name not in _BOUND:
        raise OctavoError(f"collective group {name!r} is not bound in this process (bound: "
                          f"{', '.join(sorted(_BOUND)) or 'none'}); only a rank of a parallel engine runs it")
    return _BOUND[name]


@torch.library.custom_op("octavo_rank::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group: str) -> Tensor:
    """octavo::all_reduce on the process group bound to `group`: the sum of every rank's `x` (a new tensor)."""
    shared = _SHARED.get(group)
    if shared is not None and x.device.type == "cpu" and x.dtype in REDUCIBLE_DTYPES:
        return shared.all_reduce(x)
    result = x.contiguous().clone()
    dist.all_reduce(result, group=bound_group(group))
    return result


@all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("octavo_rank::all_gather", mutates_args=())
def all_gather(x: Tensor, group: str, world_size: int, dim: int) -> Tensor:
    """octavo::all_gather on the process group bound to `group`: every rank's `x` joined along `dim`, rank order."""
    process_group = bound_group(group)
    shared = _SHARED.get(group)
    if shared is not None and x.device.type == "cpu" and shared.world_size == world_size:
        return shared.all_gather(x, dim)
    if dist.get_world_size(process_group) != world_size:
        raise OctavoError(f"all_gather over {world_size} ranks, but group {group!r} has "
                          f"{dist.get_world_size(process_group)}")
    source = x.contiguous()
    parts = [torch.empty_like(source) for _ in range(world_size)]
    dist.all_gather(parts, source, group=process_group)
    return torch.cat(parts, dim=dim)


@all_gather.register_fake
def _(x, group, world_size, dim):
    shape = list(x.shape)
    shape[dim] = shape[dim] * world_size
    return x.new_empty(shape)
