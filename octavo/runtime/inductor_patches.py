"""Adjustments to Inductor that hold only while Octavo AOT-compiles a graph.

Each is a context manager that replaces one Inductor attribute and puts the original back when the
last compile using it ends (compiles on several threads share one replacement); where the installed
torch lacks the attribute, it changes nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

_lock = threading.Lock()
_active: dict[tuple[int, str], list] = {}  # (id(owner), name) -> [original, users]


@contextlib.contextmanager
def _replaced(owner: object, name: str, make_replacement: Callable[[Callable], Callable]) -> Iterator[None]:
    """owner.name replaced by make_replacement(original) while any caller is inside this block."""
    key = (id(owner), name)
    with _lock:
        if key in _active:
            _active[key][1] += 1
        else:
            original = getattr(owner, name)
            _active[key] = [original, 1]
            setattr(owner, name, make_replacement(original))
    try:
        yield
    finally:
        with _lock:
            _active[key][1] -= 1
            if _active[key][1] == 0:
                setattr(owner, name, _active.pop(key)[0])


@contextlib.contextmanager
def without_extern_kernel_comments() -> Iterator[None]:
    """Inductor without the comment it writes above each call of an extern kernel in the C++ wrapper.

    For that comment Inductor prints the graph fragment of every extern call (each linear, each
    opaque op), then keeps only the names of its source nodes: 2 s of Python for SmolLM2's 151
    calls, for a comment in generated code.
    """
    from torch._inductor import ir

    if not hasattr(ir, "get_kernel_metadata"):
        yield
        return
    with _replaced(ir, "get_kernel_metadata", lambda original: lambda node, wrapper: ("", "")):
        yield


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

    if not hasattr(CppWrapperCpu, "codegen_int_array_var"):
        yield
        return

    def make_replacement(original: Callable) -> Callable:
        def codegen_int_array_var(self, int_array: str, writeline: Callable[..., None], *args, **kwargs) -> str:
            return original(self, int_array, _stable_writeline(self, writeline), *args, **kwargs)

        return codegen_int_array_var

    with _replaced(CppWrapperCpu, "codegen_int_array_var", make_replacement):
        yield


def _stable_writeline(wrapper: object, writeline: Callable[..., None]) -> Callable[..., None]:
    """One callable for each (object, method) pair of a bound `writeline`, held by `wrapper`."""
    owner = getattr(writeline, "__self__", None)
    function = getattr(writeline, "__func__", None)
    if owner is None or function is None:
        return writeline
    table = wrapper.__dict__.setdefault("_octavo_stable_writelines", {})
    # The kept bound method holds `owner`, so the id in its key stays unique while the wrapper lives.
    return table.setdefault((id(owner), function), writeline)
