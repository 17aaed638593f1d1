"""Shape propagation after a pass: only the nodes the pass created or rewired are recomputed.

Every node's ``meta["val"]`` (a fake tensor, a SymInt, or a tuple of them) describes what it
computes. Re-running the whole graph on fake tensors after every pass costs seconds for a real model
(thousands of nodes, a dozen passes), although a pass touches a small part of the graph. So each
propagated node also records the inputs it was propagated with (``meta["propagated_from"]``: its
target and arguments, nodes by identity); after a pass, a node is recomputed when that record is
missing (a new node) or differs (rewired arguments), or when one of its inputs was recomputed to a
different shape or dtype (or, for a placeholder, given another by the pass). Everything else keeps its
value, which is exactly what a full
re-propagation would give it: a node's fake value depends only on its target, its arguments and its
inputs' fake values.

`check_full_propagation` runs the whole graph once more and compares, node by node: the manager calls
it after the last pass, so a pass that changed something this module cannot see (mutating a node in
a way that keeps its target and arguments) still fails the compile instead of slipping through.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from octavo.errors import PassError

_RECORD = "propagated_from"


def propagate_changed(graph_module: GraphModule, fake_mode) -> int:
    """Recompute meta["val"] of the nodes a pass changed (see the module docstring); returns how many."""
    changed: set[Node] = set()
    recomputed = 0
    for node in graph_module.graph.nodes:
        if node.op == "output":
            node.meta["val"] = map_arg(node.args[0], lambda source: source.meta.get("val"))
        if node.op == "placeholder" and node.meta.get(_RECORD) != describe(node.meta.get("val")):
            changed.add(node)  # a pass gave an input another value (a weight sliced or re-laid out)
            node.meta[_RECORD] = describe(node.meta.get("val"))
        if node.op != "call_function":
            continue
        record = _record(node)
        inputs_changed = any(source in changed for source in node.all_input_nodes)
        if node.meta.get(_RECORD) == record and "val" in node.meta and not inputs_changed:
            continue
        before = node.meta.get("val")
        node.meta["val"] = _run_node(node, fake_mode)
        node.meta[_RECORD] = record
        recomputed += 1
        if before is None or describe(before) != describe(node.meta["val"]):
            changed.add(node)
    return recomputed


def propagate_all(graph_module: GraphModule, fake_mode) -> None:
    """Re-annotate every node by running the whole graph on the placeholders' fake values."""
    inputs = [node.meta["val"] for node in graph_module.graph.nodes if node.op == "placeholder"]
    try:
        with enable_python_dispatcher():
            FakeTensorProp(graph_module, fake_mode).propagate_dont_convert_inputs(*inputs)
    except Exception as error:
        raise PassError(f"shape propagation failed: {type(error).__name__}: {error}") from error
    for node in graph_module.graph.nodes:
        if node.op == "call_function":
            node.meta[_RECORD] = _record(node)
        elif node.op == "placeholder":
            node.meta[_RECORD] = describe(node.meta.get("val"))


def adopt_traced_values(graph_module: GraphModule, fake_mode) -> int:
    """Take the values the tracer left in meta["val"] as propagated; returns how many nodes had to be computed.

    torch.export annotates every node with the fake value it computed, in the same fake mode and
    by the same op implementations as a propagation, so running the whole graph again only to
    annotate it repeats that work. This records each node's inputs as a propagation would and
    computes only the nodes that carry no value. Should any value be in another fake mode, the
    whole graph is propagated instead. Nothing is taken on trust for good: the manager's final
    `check_full_propagation` recomputes every node from the placeholders and compares.
    """
    nodes = list(graph_module.graph.nodes)
    if any(mode is not fake_mode for node in nodes for mode in _fake_modes(node.meta.get("val"))):
        propagate_all(graph_module, fake_mode)
        return len(nodes)
    for node in nodes:
        if node.op == "placeholder":
            node.meta[_RECORD] = describe(node.meta.get("val"))
        elif node.op == "call_function" and "val" in node.meta:
            node.meta[_RECORD] = _record(node)
    return propagate_changed(graph_module, fake_mode)


def _fake_modes(value: Any):
    """The fake mode of every tensor in `value` (None for a real tensor)."""
    if isinstance(value, torch.Tensor):
        yield getattr(value, "fake_mode", None)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _fake_modes(item)


def check_full_propagation(graph_module: GraphModule, fake_mode) -> None:
    """Propagate the whole graph and fail naming the first node whose incremental value differed."""
    before = {node: describe(node.meta.get("val")) for node in graph_module.graph.nodes}
    propagate_all(graph_module, fake_mode)
    for node in graph_module.graph.nodes:
        after = describe(node.meta.get("val"))
        if before[node] != after:
            raise PassError(f"incremental shape propagation missed a change at node {node.name} "
                            f"({node.format_node()}): it had {before[node]}, the full propagation gives {after}")


def describe(value: Any) -> Any:
    """What shape propagation decides about a value: dtype and (symbolic) shape, recursively."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), tuple(str(dim) for dim in value.shape))
    if isinstance(value, (tuple, list)):
        return tuple(describe(item) for item in value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(value))
    return value if value is None or isinstance(value, (int, float, bool, str)) else repr(type(value))


def _record(node: Node) -> tuple:
    """The node's target and arguments, input nodes by identity (what its value depends on)."""
    def key(argument: Node) -> tuple:
        return ("node", id(argument), argument.name)

    return (node.target, repr(map_arg(node.args, key)), repr(map_arg(node.kwargs, key)))


def _run_node(node: Node, fake_mode) -> Any:
    # Under the Python dispatcher composite ops (aten.matmul) decompose with symbolic sizes, as they did
    # when torch.export traced them; some releases' C++ implementations (2.11's matmul) read concrete
    # sizes instead, which would specialize the token count to the example's.
    args = map_arg(node.args, lambda source: source.meta["val"])
    kwargs = map_arg(node.kwargs, lambda source: source.meta["val"])
    try:
        with fake_mode, enable_python_dispatcher():
            return node.target(*args, **kwargs)
    except Exception as error:
        raise PassError(f"shape propagation failed at node {node.name} ({node.format_node()}): "
                        f"{type(error).__name__}: {error}") from error
