"""graph.onnx: what the exporter and importer refuse, with clear errors."""

from __future__ import annotations

import json
import re

import onnx
import pytest
import torch

import octavo.ir.ops  # noqa: F401  (registers octavo::paged_attention)
from octavo.errors import ArtifactError
from octavo.ir.onnx_io import export_graph_to_onnx, import_graph_from_onnx

aten = torch.ops.aten

# ------------------------------------------------------------------------------------- errors


def _single_op_graph(target, args, kwargs=None) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(target, tuple(x if a is None else a for a in args), kwargs or {})
    graph.output(node)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@torch.library.custom_op("octavo_onnx_test::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.mark.parametrize(("gm", "message"), [
    (_single_op_graph(torch.ops.octavo_onnx_test.double.default, [None]), "cannot be stored in graph.onnx"),
    (_single_op_graph(torch.add, [None, None]), "cannot be stored in graph.onnx"),
    (_single_op_graph(aten.add.Tensor, [None, None], {"alpha": slice(1)}), "argument slice"),
])
def test_export_rejects_unstorable_targets_and_arguments(gm, message):
    with pytest.raises(ArtifactError, match=message):
        export_graph_to_onnx(gm)


def test_export_rejects_get_attr_nodes_and_unknown_input_specs():
    root = torch.nn.Module()
    root.weight = torch.nn.Parameter(torch.ones(2))
    graph = torch.fx.Graph()
    graph.output(graph.get_attr("weight"))
    with pytest.raises(ArtifactError, match="get_attr nodes are not supported"):
        export_graph_to_onnx(torch.fx.GraphModule(root, graph))
    with pytest.raises(ArtifactError, match=r"input_specs names \['z'\]"):
        export_graph_to_onnx(_single_op_graph(aten.neg.default, [None]), {"z": (torch.float32, [1])})


def _exported_neg() -> onnx.ModelProto:
    return export_graph_to_onnx(_single_op_graph(aten.neg.default, [None]))


@pytest.mark.parametrize("bad_target", ["aten::no_such_op.default", "builtins.eval", "os.system",
                                        "torch.load", "mylib::neg.default", "aten::neg.__class__"])
def test_import_rejects_ops_it_does_not_know(bad_target):
    model = _exported_neg()
    node = model.graph.node[0]
    template = json.loads(node.doc_string)
    node.doc_string = json.dumps({**template, "target": bad_target})
    expected = f"graph.onnx node neg_default uses op {bad_target} which this Octavo version does not know"
    with pytest.raises(ArtifactError, match=re.escape(expected)):
        import_graph_from_onnx(model)


def test_import_rejects_models_that_are_not_octavo_graphs():
    plain = _exported_neg()
    del plain.metadata_props[:]
    with pytest.raises(ArtifactError, match="not an Octavo graph"):
        import_graph_from_onnx(plain)

    no_template = _exported_neg()
    no_template.graph.node[0].doc_string = ""
    with pytest.raises(ArtifactError, match="node neg_default has no Octavo template"):
        import_graph_from_onnx(no_template)

    bad_reference = _exported_neg()
    bad_reference.graph.node[0].doc_string = json.dumps({"target": "aten::neg.default", "args": [{"$in": 3}]})
    with pytest.raises(ArtifactError, match="refers to missing input 3"):
        import_graph_from_onnx(bad_reference)

