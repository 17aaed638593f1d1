"""Write an FX GraphModule as an Octavo graph.onnx (format: octavo.ir.onnx_mapping)."""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import sympy
import torch
from onnx import TensorProto, helper

from octavo.errors import ArtifactError
from octavo.ir.onnx_import import resolve_target
from octavo.ir.onnx_mapping import (
    CUSTOM_DOMAIN,
    CUSTOM_DOMAIN_VERSION,
    FORMAT_KEY,
    FORMAT_VERSION,
    HELPER_CONSTANT_TEMPLATE,
    IR_VERSION,
    OP_NAMESPACES,
    OUTPUT_STRUCTURE_KEY,
    STANDARD_OPSET,
    TORCH_TO_ONNX_DTYPE,
    StandardCall,
    standard_call,
)

InputSpecs = dict[str, tuple[torch.dtype, list[int | str]]]


def export_graph_to_onnx(
    gm: torch.fx.GraphModule, input_specs: InputSpecs | None = None, graph_name: str = "octavo"
) -> onnx.ModelProto:
    """The ONNX model that stores ``gm``'s graph exactly (see octavo.ir.onnx_mapping).

    Every placeholder becomes a graph input, in order, typed from ``input_specs[name]``
    (dtype and dims, symbolic dims as strings) or else from ``node.meta["val"]``; weights are
    graph inputs too, never initializers. Symbols of meta shapes that ``input_specs`` names
    (``s27`` for a dim given as ``"T"``) are written under the spec's name everywhere.
    Raises ArtifactError for nodes that cannot be stored: get_attr / call_module /
    call_method nodes, targets outside aten/octavo/prims/operator/math/torch.sym_*, and
    arguments of other types than those ``encode_value`` lists.
    """
    input_specs = input_specs or {}
    placeholders = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
    unknown = sorted(set(input_specs) - set(placeholders))
    if unknown:
        raise ArtifactError(f"input_specs names {unknown}, which are not inputs of the graph")
    writer = _GraphWriter(gm.graph, input_specs)
    graph = writer.write(graph_name)
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", STANDARD_OPSET),
            helper.make_opsetid(CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION),
        ],
        ir_version=IR_VERSION,
        producer_name="octavo",
    )
    helper.set_model_props(model, {FORMAT_KEY: FORMAT_VERSION, OUTPUT_STRUCTURE_KEY: writer.output_structure})
    return model


def save_onnx(model: onnx.ModelProto, path: str | Path) -> None:
    """Write ``model`` to ``path`` as one protobuf file (graph.onnx holds no weights)."""
    onnx.save_model(model, str(path))


def target_name(target: Any) -> str:
    """The exact name of an FX call_function target, as ``resolve_target`` reads it back.

    ``torch.ops.aten.add.Tensor`` -> ``"aten::add.Tensor"``, ``operator.mul`` ->
    ``"_operator.mul"``, ``torch.sym_max`` -> ``"torch.sym_max"``. ArtifactError for any
    target that does not resolve back to the very same object.
    """
    if isinstance(target, torch._ops.OpOverload):
        name = f"{target.namespace}::{target._opname}.{target._overloadname}"
    else:
        name = f"{getattr(target, '__module__', None)}.{getattr(target, '__name__', None)}"
    if resolve_target(name) is not target:
        raise ArtifactError(
            f"FX target {target!r} cannot be stored in graph.onnx: only ops of namespaces "
            f"{', '.join(OP_NAMESPACES)} and functions of operator, math and torch.sym_* are supported"
        )
    return name


def readable_op_type(target: Any) -> str:
    """The op_type of an ``ai.octavo`` node: ``paged_attention``, ``aten_view``, ``sym_size``, ..."""
    if isinstance(target, torch._ops.OpOverload):
        op_name, overload = target._opname, target._overloadname
        suffix = "" if overload == "default" else f"_{overload}"
        if target.namespace == "octavo":
            return op_name + suffix
        if target.namespace == "aten" and op_name.startswith("sym_"):
            return op_name
        return f"{target.namespace}_{op_name}{suffix}"
    if target.__module__ == "torch":
        return target.__name__
    return f"{target.__module__.lstrip('_')}_{target.__name__}"


def encode_value(value: Any, node_reference: Callable[[torch.fx.Node], int]) -> Any:
    """The JSON form of an FX argument; FX nodes become ``{"$in": node_reference(node)}``.

    ints, finite floats, bools, strings, None and lists are JSON literals (JSON keeps int,
    float and bool apart and writes floats with repr, which round-trips); tuples,
    non-finite floats and torch dtypes, devices, layouts and memory formats become one-key
    objects: ``{"$tuple": [...]}``, ``{"$float": "-inf"}``, ``{"$dtype": "bfloat16"}``,
    ``{"$device": "cuda:0"}``, ``{"$layout": "strided"}``,
    ``{"$memory_format": "contiguous_format"}``. Anything else is an ArtifactError.
    """
    if isinstance(value, torch.fx.Node):
        return {"$in": node_reference(value)}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, list):
        return [encode_value(item, node_reference) for item in value]
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(item, node_reference) for item in value]}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, torch.layout):
        return {"$layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"$memory_format": str(value).removeprefix("torch.")}
    raise ArtifactError(f"argument {value!r} of type {type(value).__name__} cannot be stored in graph.onnx")


def _returns_several(node: torch.fx.Node) -> bool:
    """Whether ``node`` returns a tuple or list that FX unpacks with operator.getitem."""
    if isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        return len(returns) > 1 or (len(returns) == 1 and isinstance(returns[0].type, torch.ListType))
    return False


def _reads_tuple_result(node: torch.fx.Node) -> bool:
    producer = node.args[0] if node.target is operator.getitem and node.args else None
    return isinstance(producer, torch.fx.Node) and _returns_several(producer)


def _returns_nothing(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and not node.target._schema.returns


class _GraphWriter:
    """Turns one FX graph into an ONNX GraphProto plus the output structure."""

    def __init__(self, graph: torch.fx.Graph, input_specs: InputSpecs) -> None:
        self.graph = graph
        self.input_specs = input_specs
        self.positions = {node: position for position, node in enumerate(graph.nodes)}
        self.renames = _symbol_renames(graph, input_specs)
        self.value_names: dict[torch.fx.Node, str] = {}  # FX node -> the ONNX value holding its result
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self.output_structure = "null"

    def write(self, graph_name: str) -> onnx.GraphProto:
        for node in self.graph.nodes:
            if node.op == "placeholder":
                self._write_placeholder(node)
            elif node.op == "call_function" and _reads_tuple_result(node):
                self._write_getitem(node)
            elif node.op == "call_function":
                self._write_call(node)
            elif node.op == "output":
                self._write_output(node)
            else:
                raise ArtifactError(
                    f"cannot store node {node.name} in graph.onnx: {node.op} nodes are not supported "
                    "(weights must be placeholders)"
                )
        declared = {value.name for value in [*self.inputs, *self.outputs]}
        value_info = [value for value in self.value_info if value.name not in declared]
        return helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, value_info=value_info)

    def _write_placeholder(self, node: torch.fx.Node) -> None:
        if node.name in self.input_specs:
            dtype, dims = self.input_specs[node.name]
            value = _tensor_value_info(node.name, dtype, dims)
        else:
            value = self._value_info(node.name, node.meta.get("val")) or _unknown_value_info(node.name)
        value.doc_string = json.dumps({"target": node.target, "args": encode_value(node.args, _no_node)})
        self.inputs.append(value)
        self.value_names[node] = node.name

    def _write_call(self, node: torch.fx.Node) -> None:
        template: dict[str, Any] = {"target": target_name(node.target)}
        referenced = _nodes_in((node.args, node.kwargs))
        for used in referenced:
            if used not in self.value_names:
                raise ArtifactError(
                    f"cannot store node {node.name} in graph.onnx: it uses {used.name}, which has no "
                    "single value (a tuple result must be read through operator.getitem)"
                )
        outputs = self._output_names(node)
        call = standard_call(node)
        if call is not None:
            call_nodes = {value for value in call.inputs if isinstance(value, torch.fx.Node)}
            if call.num_outputs != len(outputs) or not set(referenced) <= call_nodes:
                call = None
        inputs = self._standard_inputs(node, call) if call else list(dict.fromkeys(referenced))
        input_names = [name if isinstance(name, str) else self.value_names[name] for name in inputs]

        def reference(used: torch.fx.Node) -> int:
            return input_names.index(self.value_names[used])

        template["args"] = encode_value(list(node.args), reference)
        template["kwargs"] = {key: encode_value(v, reference) for key, v in node.kwargs.items()}
        if _returns_several(node):
            template["getitems"] = self._getitem_records(node)
        self.nodes.append(
            helper.make_node(
                call.op_type if call else readable_op_type(node.target),
                input_names,
                outputs,
                name=node.name,
                domain="" if call else CUSTOM_DOMAIN,
                doc_string=json.dumps(template),
                **(call.attributes if call else {}),
            )
        )
        self._record_output_types(node, outputs)

    def _standard_inputs(self, node: torch.fx.Node, call: StandardCall) -> list[torch.fx.Node | str]:
        """The call's inputs, its constants replaced by the names of Constant nodes added here."""
        inputs: list[torch.fx.Node | str] = []
        for position, value in enumerate(call.inputs):
            if isinstance(value, torch.fx.Node):
                inputs.append(value)
                continue
            name = f"{node.name}.const{position}"  # FX names are identifiers: no clash with a '.'
            tensor = helper.make_tensor(
                name, TORCH_TO_ONNX_DTYPE[value.dtype], list(value.shape),
                value.reshape(-1).view(torch.uint8).numpy().tobytes(), raw=True,
            )
            self.nodes.append(
                helper.make_node(
                    "Constant", [], [name], name=name, value=tensor,
                    doc_string=json.dumps(HELPER_CONSTANT_TEMPLATE),
                )
            )
            inputs.append(name)
        return inputs

    def _output_names(self, node: torch.fx.Node) -> list[str]:
        if _returns_nothing(node):
            return []
        if not _returns_several(node):
            self.value_names[node] = node.name
            return [node.name]
        meta = node.meta.get("val")
        first_getitems = self._first_getitems(node)
        count = max([len(meta) if isinstance(meta, list | tuple) else 0, *(i + 1 for i in first_getitems)])
        names = []
        for index in range(count):
            getitem = first_getitems.get(index)
            names.append(getitem.name if getitem else f"{node.name}.unused{index}")
            if getitem:
                self.value_names[getitem] = getitem.name
        return names

    def _first_getitems(self, node: torch.fx.Node) -> dict[int, torch.fx.Node]:
        """The first (in graph order) operator.getitem user of each result index of ``node``."""
        first: dict[int, torch.fx.Node] = {}
        for user in sorted(node.users, key=self.positions.__getitem__):
            index = user.args[1] if user.target is operator.getitem and len(user.args) == 2 else None
            if type(index) is not int or index < 0:
                raise ArtifactError(
                    f"cannot store node {node.name} in graph.onnx: its tuple result is used by "
                    f"{user.name} other than through operator.getitem with a non-negative int index"
                )
            first.setdefault(index, user)
        return first

    def _getitem_records(self, node: torch.fx.Node) -> list[dict[str, Any]]:
        return [
            {"name": g.name, "index": index, "after": g.prev.name, "position": self.positions[g]}
            for index, g in sorted(self._first_getitems(node).items())
        ]

    def _write_getitem(self, node: torch.fx.Node) -> None:
        producer, index = node.args
        if self._first_getitems(producer)[index] is node:
            return  # an output of the producer's ONNX node, recorded in its template
        # A repeated getitem of the same result is a distinct FX node; it reads the same value.
        template = {"getitem_of": producer.name, "index": index}
        source = self.value_names[self._first_getitems(producer)[index]]
        self.nodes.append(
            helper.make_node(
                "Identity", [source], [node.name], name=node.name, doc_string=json.dumps(template)
            )
        )
        self.value_names[node] = node.name
        self._record_output_types(node, [node.name])

    def _write_output(self, node: torch.fx.Node) -> None:
        returned = list(dict.fromkeys(_nodes_in(node.args[0])))
        for value in returned:
            if value not in self.value_names:
                raise ArtifactError(
                    f"cannot store graph output {value.name} in graph.onnx: it has no single value"
                )
            name = self.value_names[value]
            self.outputs.append(self._value_info(name, value.meta.get("val")) or _unknown_value_info(name))
        self.output_structure = json.dumps(encode_value(node.args[0], returned.index))

    def _record_output_types(self, node: torch.fx.Node, outputs: list[str]) -> None:
        meta = node.meta.get("val")
        if meta is None:
            return
        values = list(meta) if _returns_several(node) else [meta]
        for name, value in zip(outputs, values, strict=False):
            info = self._value_info(name, value)
            if info is not None:
                self.value_info.append(info)

    def _value_info(self, name: str, meta: Any) -> onnx.ValueInfoProto | None:
        """The ONNX type of an FX value from its meta: tensors, and SymInt/SymFloat/SymBool scalars."""
        if isinstance(meta, torch.Tensor) and meta.dtype in TORCH_TO_ONNX_DTYPE:
            return _tensor_value_info(name, meta.dtype, [self._dim(size) for size in meta.shape])
        for python_type, symbolic_type, element_type in (
            (bool, torch.SymBool, TensorProto.BOOL),
            (int, torch.SymInt, TensorProto.INT64),
            (float, torch.SymFloat, TensorProto.DOUBLE),
        ):
            if isinstance(meta, python_type | symbolic_type):
                return helper.make_tensor_value_info(name, element_type, [])
        return None

    def _dim(self, size: int | torch.SymInt) -> int | str:
        if isinstance(size, int):
            return size
        expression = size.node.expr
        return int(expression) if expression.is_number else str(expression.xreplace(self.renames))


def _symbol_renames(graph: torch.fx.Graph, input_specs: InputSpecs) -> dict[sympy.Symbol, sympy.Symbol]:
    """Meta shape symbols that ``input_specs`` names, e.g. {s27: T}."""
    renames: dict[sympy.Symbol, sympy.Symbol] = {}
    for node in graph.find_nodes(op="placeholder"):
        meta = node.meta.get("val")
        if node.name not in input_specs or not isinstance(meta, torch.Tensor):
            continue
        for size, dim in zip(meta.shape, input_specs[node.name][1], strict=False):
            if isinstance(size, torch.SymInt) and isinstance(dim, str) and size.node.expr.is_symbol:
                renames[size.node.expr] = sympy.Symbol(dim)
    return renames


def _tensor_value_info(name: str, dtype: torch.dtype, dims: list[int | str]) -> onnx.ValueInfoProto:
    if dtype not in TORCH_TO_ONNX_DTYPE:
        raise ArtifactError(f"graph input {name} has dtype {dtype}, which ONNX cannot describe")
    return helper.make_tensor_value_info(name, TORCH_TO_ONNX_DTYPE[dtype], list(dims))


def _unknown_value_info(name: str) -> onnx.ValueInfoProto:
    # The checker wants an element type and a shape field on graph inputs and outputs; with
    # no meta there is neither, so write UNDEFINED and an empty shape, and say so.
    value = helper.make_tensor_value_info(name, TensorProto.UNDEFINED, [])
    value.doc_string = "type unknown: the FX node had no meta['val']"
    return value


def _nodes_in(value: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, found.append)
    return found


def _no_node(node: torch.fx.Node) -> int:
    raise ArtifactError(f"placeholder argument refers to node {node.name}")
