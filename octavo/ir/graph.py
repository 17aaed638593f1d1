"""Graph utilities shared by every layer: op names, histograms, verification, readable printing."""

from __future__ import annotations

import operator
import re
from collections import Counter

import torch
from torch.fx import GraphModule, Node

from octavo.errors import OctavoError

_ALLOWED_NAMESPACES = ("aten", "octavo", "prims")


def op_name(node: Node) -> str:
    """A readable name of what a node computes: "aten.linear", "octavo.paged_attention", "operator.mul"."""
    if node.op != "call_function":
        return node.op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        namespace, name = target.name().split("::", 1)
        overload = target._overloadname
        name = name.split(".")[0]
        return f"{namespace}.{name}" if overload == "default" else f"{namespace}.{name}.{overload}"
    module = getattr(target, "__module__", None) or ""
    if module in ("_operator", "operator"):
        return f"operator.{target.__name__}"
    return f"{module}.{getattr(target, '__name__', repr(target))}"


def op_histogram(graph_module: GraphModule) -> dict[str, int]:
    """How many call_function nodes of each op the graph holds, most frequent first."""
    counts = Counter(op_name(node) for node in graph_module.graph.nodes if node.op == "call_function")
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def count_ops(graph_module: GraphModule, name: str) -> int:
    """Number of call_function nodes whose op_name is `name` or starts with `name.` (any overload)."""
    return sum(1 for node in graph_module.graph.nodes
               if node.op == "call_function" and (op_name(node) == name or op_name(node).startswith(name + ".")))


def find_nodes(graph_module: GraphModule, target) -> list[Node]:
    """All call_function nodes with exactly this target (an OpOverload or a function)."""
    return [node for node in graph_module.graph.nodes if node.op == "call_function" and node.target is target]


def verify_graph(graph_module: GraphModule) -> None:
    """Lint the graph and check that it only calls ops of the Octavo op set.

    Allowed: call_function of aten/octavo/prims ops, operator and math functions and
    torch.sym_*; placeholder, get_attr and output nodes. Anything else is an OctavoError.
    """
    try:
        graph_module.graph.lint()
    except Exception as error:
        raise OctavoError(f"graph failed verification: {error}") from error
    for node in graph_module.graph.nodes:
        if node.op in ("call_module", "call_method"):
            raise OctavoError(f"graph node {node.name} is a {node.op}; only call_function is allowed")
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            if target.namespace not in _ALLOWED_NAMESPACES:
                raise OctavoError(f"graph node {node.name} calls {target}, outside the Octavo op set")
        elif not _is_allowed_function(target):
            raise OctavoError(f"graph node {node.name} calls {target!r}, outside the Octavo op set")


def _is_allowed_function(target) -> bool:
    """operator and math functions, and of module torch only the symbolic-size helpers (torch.sym_*).

    The same set graph.onnx can store (octavo.ir.onnx_import.resolve_target); torch.relu and the
    like are not ATen ops and must not slip through as "module torch".
    """
    module = getattr(target, "__module__", None)
    if module in ("_operator", "operator", "math"):
        return True
    return module == "torch" and getattr(target, "__name__", "").startswith("sym_")


def format_value(value, symbol_names: dict[str, str] | None = None) -> str:
    """`f32[T, 576]` for a (fake) tensor, symbols renamed through `symbol_names`."""
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(format_value(item, symbol_names) for item in value) + ")"
    if isinstance(value, torch.Tensor):
        dims = ", ".join(_format_dim(dim, symbol_names) for dim in value.shape)
        return f"{_DTYPE_SHORT.get(value.dtype, str(value.dtype))}[{dims}]"
    if isinstance(value, torch.SymInt):
        return "sym " + _format_dim(value, symbol_names)
    return type(value).__name__ if value is not None else "?"


def format_graph(graph_module: GraphModule, symbol_names: dict[str, str] | None = None) -> str:
    """One line per node: `%name: f32[T, 576] = aten.linear(%x, %w)`."""
    lines = []
    for node in graph_module.graph.nodes:
        value = format_value(node.meta.get("val"), symbol_names)
        if node.op == "placeholder":
            lines.append(f"input %{node.name}: {value}")
        elif node.op == "output":
            lines.append(f"return {_format_argument(node.args[0])}")
        else:
            arguments = [_format_argument(arg) for arg in node.args]
            arguments += [f"{key}={_format_argument(arg)}" for key, arg in node.kwargs.items()]
            lines.append(f"%{node.name}: {value} = {op_name(node)}({', '.join(arguments)})")
    return "\n".join(lines) + "\n"


def _format_dim(dim, symbol_names: dict[str, str] | None) -> str:
    text = str(dim)
    if symbol_names:
        text = re.sub(r"\b[su]\d+\b", lambda match: symbol_names.get(match.group(0), match.group(0)), text)
    return text


def _format_argument(argument) -> str:
    if isinstance(argument, Node):
        return f"%{argument.name}"
    if isinstance(argument, (list, tuple)):
        inner = ", ".join(_format_argument(item) for item in argument)
        return f"[{inner}]" if isinstance(argument, list) else f"({inner})"
    if isinstance(argument, torch.dtype):
        return _DTYPE_SHORT.get(argument, str(argument))
    if isinstance(argument, float):
        return repr(argument)
    return str(argument)


_DTYPE_SHORT = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "bool",
    torch.float8_e4m3fn: "f8e4m3",
}

GETITEM = operator.getitem
