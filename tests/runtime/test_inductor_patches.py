"""The Inductor adjustments Octavo makes while it compiles, on Inductor's real C++ wrapper."""

import torch
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch._inductor.graph import GraphLowering
from torch._inductor.utils import IndentedBuffer
from torch._inductor.virtualized import V

from octavo.runtime.inductor_patches import stable_int_array_declarations, without_extern_kernel_comments


def _wrapper_graph() -> GraphLowering:
    return GraphLowering(torch.fx.symbolic_trace(lambda x: x + 1), cpp_wrapper=True, aot_mode=True)


def test_every_buffer_declares_the_int_arrays_it_uses():
    """Arrays named through short-lived bound methods of different buffers are declared in each buffer.

    Each `buffer.writeline` below is a new bound method freed after the call, so CPython tends to
    give the next one the same id: the case that made a compiled wrapper use an undeclared array.
    """
    buffers = [IndentedBuffer() for _ in range(4)]
    with V.set_graph_handler(_wrapper_graph()), stable_int_array_declarations():
        wrapper = CppWrapperCpu()
        names = [wrapper.codegen_int_array_var("{4, 8}", buffer.writeline) for buffer in buffers]
        again = wrapper.codegen_int_array_var("{4, 8}", buffers[0].writeline)
    for name, buffer in zip(names, buffers, strict=True):
        assert f"{name}[] = {{4, 8}};" in buffer.getvalue(), (name, buffer.getvalue())
    assert len(set(names)) == len(buffers)
    assert again == names[0]  # within one buffer the declaration is still shared
    assert buffers[0].getvalue().count("{4, 8}") == 1


def test_the_adjustments_end_with_their_block():
    """Inductor's own functions are back in place after the compile, even one that failed."""
    from torch._inductor import ir

    originals = (CppWrapperCpu.codegen_int_array_var, getattr(ir, "get_kernel_metadata", None))
    try:
        with stable_int_array_declarations(), without_extern_kernel_comments():
            assert CppWrapperCpu.codegen_int_array_var is not originals[0]
            raise RuntimeError("compile failed")
    except RuntimeError:
        pass
    assert (CppWrapperCpu.codegen_int_array_var, getattr(ir, "get_kernel_metadata", None)) == originals


def test_overlapping_compiles_share_one_replacement_and_restore_the_original():
    """Two compiles on different threads whose blocks overlap: the replacement holds until the later one ends."""
    import threading

    original = CppWrapperCpu.codegen_int_array_var
    first_inside, second_done = threading.Event(), threading.Event()
    seen = []

    def second():
        first_inside.wait()
        with stable_int_array_declarations():
            seen.append(CppWrapperCpu.codegen_int_array_var)
        second_done.set()

    thread = threading.Thread(target=second)
    thread.start()
    with stable_int_array_declarations():
        seen.append(CppWrapperCpu.codegen_int_array_var)
        first_inside.set()
        second_done.wait()
        assert CppWrapperCpu.codegen_int_array_var is seen[0]  # the second's exit left the first's in place
    thread.join()
    assert seen[0] is seen[1] and seen[0] is not original
    assert CppWrapperCpu.codegen_int_array_var is original
