"""Registering ops that write some of their arguments in place.

``torch.library.custom_op`` installs, for an op that mutates arguments, a
Python ADInplaceOrView kernel that reads each mutated argument by its
position in ``args``. In torch 2.11 that kernel does not fill in schema
defaults, so a call that omits an optional mutated argument (the scale
caches of ``octavo::paged_attention`` when the cache is not quantized), or
passes it by keyword, fails with ``IndexError: tuple index out of range``.
Later releases fill the defaults first.

Such ops are therefore defined here through the lower-level ``torch.library``
API: the schema is inferred from the Python signature exactly as
``custom_op`` infers it, the implementation is registered for every backend
(CompositeExplicitAutograd), and the fake impl is registered as usual. The
ADInplaceOrView key then falls through (no version-counter bump: octavo ops
never run under autograd), and the op's behaviour, schema, fake impl and
functionalization under torch.export / torch.compile are those of a
``custom_op`` on every torch version.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

# Libraries must outlive the ops they define: a collected Library deregisters them.
_LIBRARIES: dict[str, torch.library.Library] = {}


class MutatingOp:
    """An op of ``namespace::name`` that writes the arguments in ``mutates_args``; called like the function."""

    def __init__(self, qualname: str, function: Callable, mutates_args: Iterable[str], schema: str | None = None):
        namespace, name = qualname.split("::", 1)
        signature = schema or torch.library.infer_schema(function, mutates_args=tuple(mutates_args))
        library = _LIBRARIES.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
        library.define(f"{name}{signature}")
        library.impl(name, function, "CompositeExplicitAutograd")
        self._library = library
        self.qualname = qualname
        self.default: torch._ops.OpOverload = getattr(getattr(torch.ops, namespace), name).default
        functools.update_wrapper(self, function)

    def __call__(self, *args, **kwargs):
        return self.default(*args, **kwargs)

    def register_fake(self, fake: Callable) -> Callable:
        """Register `fake` as the op's shape function (used as a decorator, like CustomOpDef.register_fake)."""
        torch.library.register_fake(self.qualname, fake, lib=self._library)
        return fake


def mutating_op(qualname: str, *, mutates_args: Iterable[str]) -> Callable[[Callable], MutatingOp]:
    """Decorator form of MutatingOp: ``@mutating_op("octavo::name", mutates_args=(...))``."""
    return lambda function: MutatingOp(qualname, function, mutates_args)
