"""Backend kernels as torch.library custom ops: what lowering points the graph's octavo nodes at.

A backend written in Python (the torch and Triton backends) registers each of
its kernels as an op of its own namespace (``octavo_torch::rms_norm``, ...),
with exactly the schema of the octavo op it implements and a fake impl that is
the octavo op's own. A lowered graph then holds only OpOverloads: eager
execution dispatches them like any ATen op, and torch.compile / export see
opaque ops with known shapes instead of tracing into (or breaking on) Python
kernel code. Native backends register their kernels with TORCH_LIBRARY and
need none of this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from octavo.ir.ops.mutating_op import MutatingOp

_REGISTERED: dict[str, torch._ops.OpOverload] = {}


def kernel_op(namespace: str, reference: torch._ops.OpOverload, kernel: Callable) -> torch._ops.OpOverload:
    """`kernel` registered as ``namespace::<name of reference>`` (once per process); its OpOverload.

    `reference` is the octavo op the kernel implements: its schema (arguments,
    defaults, which arguments are written in place) and its fake impl become
    the new op's. The kernel must return fresh tensors (custom ops may not
    return an alias of an input).
    """
    name = f"{namespace}::{reference._schema.name.split('::', 1)[1]}"
    if name in _REGISTERED:
        return _REGISTERED[name]
    schema = str(reference._schema)
    signature = schema[schema.index("("):]
    mutated = [argument.name for argument in reference._schema.arguments
               if argument.alias_info is not None and argument.alias_info.is_write]
    if mutated:
        op = MutatingOp(name, kernel, mutated, schema=signature)
    else:
        op = torch.library.custom_op(name, kernel, mutates_args=(), schema=signature)

    @op.register_fake
    def _(*args, **kwargs):
        return reference(*args, **kwargs)

    overload = getattr(getattr(torch.ops, namespace), reference._schema.name.split("::", 1)[1]).default
    _REGISTERED[name] = overload
    return overload


def kernel_op_table(namespace: str, kernels: dict[torch._ops.OpOverload, Callable]) -> dict:
    """{octavo op: its kernel as an op of `namespace`} for every entry of `kernels`.

    A kernel that already is an op (a reference op serving as its own kernel) is kept as it is.
    """
    return {reference: kernel if isinstance(kernel, torch._ops.OpOverload) else kernel_op(namespace, reference, kernel)
            for reference, kernel in kernels.items()}
