"""Rebuild the exact FX GraphModule stored in an Octavo graph.onnx (format: octavo.ir.onnx_mapping).

Only the templates in the nodes' doc_strings are read; ONNX op types, attributes and the
Constant nodes added for standard ops are ignored. Targets are looked up by name in a fixed
set of namespaces; nothing in the file is imported, evaluated or unpickled.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import torch

import octavo.ir.ops  # noqa: F401  (registers the octavo:: ops so that templates can name them)
from octavo.errors import ArtifactError
from octavo.ir.onnx_mapping import (
    FORMAT_KEY,
    FORMAT_VERSION,
    HELPER_CONSTANT_TEMPLATE,
    OP_NAMESPACES,
    OUTPUT_STRUCTURE_KEY,
    PYTHON_MODULES,
)

_OP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FUNCTION_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def import_graph_from_onnx(model_or_path: onnx.ModelProto | str | Path) -> torch.fx.GraphModule:
    """The FX GraphModule that ``export_graph_to_onnx`` stored in ``model_or_path``.

    Node names, placeholder order, targets, args/kwargs (including list vs tuple, dtypes,
    devices and non-finite floats) and the output structure are those of the exported
    graph; node.meta is not stored, so it is empty. Raises ArtifactError when the model is
    not an Octavo graph (no format key, a node without template) or names an op this
    version of Octavo does not know.
    """
    model = model_or_path if isinstance(model_or_path, onnx.ModelProto) else onnx.load(str(model_or_path))
    properties = {prop.key: prop.value for prop in model.metadata_props}
    if properties.get(FORMAT_KEY) != FORMAT_VERSION:
        raise ArtifactError(
            f"graph.onnx is not an Octavo graph of format {FORMAT_VERSION} "
            f"(metadata {FORMAT_KEY!r} is {properties.get(FORMAT_KEY)!r})"
        )
    try:
        return _GraphReader(model, properties).read()
    except (KeyError, TypeError, IndexError, AttributeError) as error:
        raise ArtifactError(f"graph.onnx is not a well-formed Octavo graph: {error!r}") from error


def resolve_target(name: str) -> Callable[..., Any] | None:
    """The callable a template's target names, or None when it is not an allowed target.

    ``"aten::add.Tensor"`` -> torch.ops.aten.add.Tensor (namespaces aten, octavo, prims),
    ``"_operator.mul"`` / ``"operator.mul"`` -> operator.mul, ``"math.ceil"``, and
    ``"torch.sym_max"`` (of module torch only the ``sym_*`` functions).
    """
    if "::" in name:
        namespace, _, rest = name.partition("::")
        op_name, _, overload = rest.partition(".")
        if namespace not in OP_NAMESPACES or not (_OP_NAME.match(op_name) and _OP_NAME.match(overload)):
            return None
        try:
            op = getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
        except (AttributeError, RuntimeError):
            return None
        return op if isinstance(op, torch._ops.OpOverload) else None
    module_name, _, function_name = name.rpartition(".")
    module = PYTHON_MODULES.get(module_name)
    if module is None or not _FUNCTION_NAME.match(function_name):
        return None
    if module is torch and not function_name.startswith("sym_"):
        return None
    function = getattr(module, function_name, None)
    return function if callable(function) and not isinstance(function, type) else None


def decode_value(encoded: Any, node_at: Callable[[int], torch.fx.Node]) -> Any:
    """The FX argument a template value stands for; ``{"$in": k}`` becomes ``node_at(k)``.

    The inverse of ``octavo.ir.onnx_export.encode_value``.
    """
    if isinstance(encoded, list):
        return [decode_value(item, node_at) for item in encoded]
    if not isinstance(encoded, dict):
        return encoded
    if len(encoded) != 1:
        raise ArtifactError(f"graph.onnx has a malformed argument template {encoded!r}")
    ((kind, payload),) = encoded.items()
    if kind == "$in" and type(payload) is int:
        return node_at(payload)
    if kind == "$tuple" and isinstance(payload, list):
        return tuple(decode_value(item, node_at) for item in payload)
    if kind == "$float" and payload in ("inf", "-inf", "nan"):
        return float(payload)
    if kind == "$device" and isinstance(payload, str):
        try:
            return torch.device(payload)
        except RuntimeError:
            pass
    expected_type = {"$dtype": torch.dtype, "$layout": torch.layout, "$memory_format": torch.memory_format}
    value = getattr(torch, payload, None) if isinstance(payload, str) else None
    if kind in expected_type and isinstance(value, expected_type[kind]):
        return value
    raise ArtifactError(f"graph.onnx has a malformed argument template {encoded!r}")


class _GraphReader:
    """Rebuilds one FX graph from the ONNX graph of an Octavo model."""

    def __init__(self, model: onnx.ModelProto, properties: dict[str, str]) -> None:
        self.model = model
        self.properties = properties
        self.graph = torch.fx.Graph()
        self.values: dict[str, torch.fx.Node] = {}  # ONNX value name -> FX node
        self.nodes: dict[str, torch.fx.Node] = {}  # FX node name -> FX node
        self.getitems: list[tuple[int, str, torch.fx.Node]] = []  # (position, after, getitem node)

    def read(self) -> torch.fx.GraphModule:
        for value in self.model.graph.input:
            self._read_placeholder(value)
        for onnx_node in self.model.graph.node:
            self._read_node(onnx_node)
        self._read_output()
        self._restore_getitem_positions()
        return torch.fx.GraphModule(torch.nn.Module(), self.graph)

    def _add(self, fx_node: torch.fx.Node, name: str) -> None:
        if fx_node.name != name:
            raise ArtifactError(f"graph.onnx node name {name!r} is not a valid, unique FX node name")
        self.nodes[name] = fx_node

    def _read_placeholder(self, value: onnx.ValueInfoProto) -> None:
        template = _parse_template(value.doc_string, f"graph input {value.name}")
        args = decode_value(template.get("args", []), lambda k: self._no_reference(value.name))
        fx_node = self.graph.create_node("placeholder", template["target"], tuple(args), name=value.name)
        self._add(fx_node, value.name)
        self.values[value.name] = fx_node

    def _read_node(self, onnx_node: onnx.NodeProto) -> None:
        template = _parse_template(onnx_node.doc_string, f"node {onnx_node.name}")
        if template == HELPER_CONSTANT_TEMPLATE:
            return
        if "getitem_of" in template:  # a second getitem of one output, stored as an Identity node
            producer = self._node_named(template["getitem_of"], onnx_node.name)
            fx_node = self._getitem(producer, template["index"], onnx_node.name)
            self._add(fx_node, onnx_node.name)
            self.values[onnx_node.output[0]] = fx_node
            return
        target = resolve_target(str(template.get("target")))
        if target is None:
            raise ArtifactError(
                f"graph.onnx node {onnx_node.name} uses op {template.get('target')} "
                "which this Octavo version does not know"
            )
        node_at = lambda k: self._input(onnx_node, k)  # noqa: E731
        args = decode_value(template.get("args", []), node_at)
        kwargs = {key: decode_value(v, node_at) for key, v in template.get("kwargs", {}).items()}
        fx_node = self.graph.create_node("call_function", target, tuple(args), kwargs, name=onnx_node.name)
        self._add(fx_node, onnx_node.name)
        if "getitems" not in template:
            self.values.update({output: fx_node for output in onnx_node.output[:1]})
            return
        for record in template["getitems"]:
            getitem = self._getitem(fx_node, record["index"], record["name"])
            self._add(getitem, record["name"])
            self.values[onnx_node.output[record["index"]]] = getitem
            self.getitems.append((record["position"], record["after"], getitem))

    def _getitem(self, producer: torch.fx.Node, index: int, name: str) -> torch.fx.Node:
        return self.graph.create_node("call_function", operator.getitem, (producer, index), name=name)

    def _read_output(self) -> None:
        if OUTPUT_STRUCTURE_KEY not in self.properties:
            raise ArtifactError(
                f"graph.onnx is not an Octavo graph: metadata {OUTPUT_STRUCTURE_KEY!r} is missing"
            )
        outputs = self.model.graph.output
        structure = json.loads(self.properties[OUTPUT_STRUCTURE_KEY])

        def output_at(k: int) -> torch.fx.Node:
            if not 0 <= k < len(outputs):
                raise ArtifactError(f"graph.onnx output structure refers to missing output {k}")
            return self._value(outputs[k].name, "the graph output")

        self.graph.output(decode_value(structure, output_at))

    def _restore_getitem_positions(self) -> None:
        # Every getitem was created right after its producer; move each back behind the node
        # it followed in the exported graph. Going by original position keeps that node in
        # its final place already.
        for _, after, getitem in sorted(self.getitems, key=lambda item: item[0]):
            self._node_named(after, getitem.name).append(getitem)

    def _input(self, onnx_node: onnx.NodeProto, k: int) -> torch.fx.Node:
        if not 0 <= k < len(onnx_node.input):
            raise ArtifactError(f"graph.onnx node {onnx_node.name} template refers to missing input {k}")
        return self._value(onnx_node.input[k], f"node {onnx_node.name}")

    def _value(self, name: str, user: str) -> torch.fx.Node:
        if name not in self.values:
            raise ArtifactError(f"graph.onnx {user} reads value {name!r}, which no earlier node produces")
        return self.values[name]

    def _node_named(self, name: str, user: str) -> torch.fx.Node:
        if name not in self.nodes:
            raise ArtifactError(f"graph.onnx node {user} refers to unknown node {name!r}")
        return self.nodes[name]

    @staticmethod
    def _no_reference(name: str) -> torch.fx.Node:
        raise ArtifactError(f"graph.onnx graph input {name} has a template that refers to a node")


def _parse_template(doc_string: str, what: str) -> dict[str, Any]:
    try:
        template = json.loads(doc_string)
    except json.JSONDecodeError:
        template = None
    if not isinstance(template, dict):
        raise ArtifactError(f"graph.onnx is not an Octavo graph: {what} has no Octavo template")
    return template
