"""Adjustments to Inductor that hold only while Octavo AOT-compiles a graph.

Each is a context manager that replaces one Inductor function and puts the original back on exit;
where the installed torch lacks the function, it changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def without_extern_kernel_comments() -> Iterator[None]:
    """Inductor without the comment it writes above each call of an extern kernel in the C++ wrapper.

    For that comment Inductor prints the graph fragment of every extern call (each linear, each
    opaque op), then keeps only the names of its source nodes: 2 s of Python for SmolLM2's 151
    calls, for a comment in generated code.
    """
    from torch._inductor import ir

    original = getattr(ir, "get_kernel_metadata", None)
    if original is None:
        yield
        return
    ir.get_kernel_metadata = lambda node, wrapper: ("", "")
    try:
        yield
    finally:
        ir.get_kernel_metadata = original


@contextlib.contextmanager
def stable_int_array_declarations() -> Iterator[None]:
    """The C++ wrapper's size and stride arrays declared once for each code buffer that uses them.

    The wrapper caches the name of each array it has declared, keyed by the array and by the
    `writeline` it was written through; torch 2.11 keys by `id(writeline)`, the id of a bound
    method that is freed right after the call. A later bound method of another buffer (memory
    planning's second pass writes into a new one) can get the same id, hit the entry, and use an
    array whose declaration went to the first buffer: g++ then fails with "'int_array_N' was not
    declared in this scope", depending on where CPython put the objects. Here every bound method
    is replaced by one callable per (buffer, method), kept alive with its buffer for the whole
    wrapper, so equal keys mean the same buffer on every torch; torch releases that key by the
    buffer themselves get the same keys as before.
    """
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    original = getattr(CppWrapperCpu, "codegen_int_array_var", None)
    if original is None:
        yield
        return

    def codegen_int_array_var(self, int_array: str, writeline: Callable[..., None], *args, **kwargs) -> str:
        return original(self, int_array, _stable_writeline(self, writeline), *args, **kwargs)

    CppWrapperCpu.codegen_int_array_var = codegen_int_array_var
    try:
        yield
    finally:
        CppWrapperCpu.codegen_int_array_var = original


def _stable_writeline(wrapper: object, writeline: Callable[..., None]) -> Callable[..., None]:
    """One callable for each (object, method) pair of a bound `writeline`, held by `wrapper`."""
    owner = getattr(writeline, "__self__", None)
    function = getattr(writeline, "__func__", None)
    if owner is None or function is None:
        return writeline
    table = wrapper.__dict__.setdefault("_octavo_stable_writelines", {})
    key = (id(owner), function)
    if key not in table:
        # The entry holds `owner`, so its id stays unique while the wrapper lives.
        table[key] = (owner, writeline)
    return table[key][1]
