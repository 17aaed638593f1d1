"""Shared helpers of the graph.onnx round-trip tests."""

from __future__ import annotations

import math

import onnx
import torch

import octavo.ir.ops  # noqa: F401  (registers octavo::paged_attention)
from octavo.frontend.trace import trace_module
from octavo.ir.onnx_io import export_graph_to_onnx, import_graph_from_onnx

aten = torch.ops.aten

# ------------------------------------------------------------------------------------- helpers


def round_trip(gm: torch.fx.GraphModule, input_specs=None) -> tuple[onnx.ModelProto, torch.fx.GraphModule]:
    """Export, check with the full ONNX checker, serialize to bytes, parse, import."""
    model = export_graph_to_onnx(gm, input_specs)
    onnx.checker.check_model(model, full_check=True)
    parsed = onnx.load_model_from_string(model.SerializeToString())
    return model, import_graph_from_onnx(parsed)


def describe(value):
    """A comparable description of an FX argument that keeps list/tuple/int/float/bool apart."""
    if isinstance(value, torch.fx.Node):
        return ("node", value.name)
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(describe(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple((key, describe(item)) for key, item in value.items()))
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, value)


def graph_description(gm: torch.fx.GraphModule) -> list[tuple]:
    return [
        (node.op, node.name, node.target, describe(node.args), describe(dict(node.kwargs)))
        for node in gm.graph.nodes
    ]


def assert_same_graph(original: torch.fx.GraphModule, imported: torch.fx.GraphModule) -> None:
    assert graph_description(imported) == graph_description(original)


def assert_bitwise_equal(actual, expected) -> None:
    if isinstance(expected, list | tuple):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_bitwise_equal(a, e)
    else:
        assert actual.dtype == expected.dtype and torch.equal(actual, expected)


def onnx_node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(node for node in model.graph.node if node.name == name)


def trace_hf(model_class, config_class, **extra):
    config = config_class(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, **extra,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_class(config).eval()
    return trace_module(model).program


def program_inputs(program, input_ids, positions) -> list[torch.Tensor]:
    """The graph's positional inputs: weights from the state dict / constants, then the tokens."""
    tensors = {**program.state_dict, **program.constants}
    values = []
    for spec in program.graph_signature.input_specs:
        if spec.arg.name == "input_ids":
            values.append(input_ids)
        elif spec.arg.name == "positions":
            values.append(positions)
        else:
            values.append(tensors[spec.target])
    return values


TOKEN_SPECS = {"input_ids": (torch.int64, ["T"]), "positions": (torch.int64, ["T"])}



def small_matrix() -> torch.Tensor:
    """A 3x4 float32 input with values of both signs whose results are exact in float32."""
    return torch.tensor([[0.5, -1.25, 2.0, 3.5], [-0.75, 1.5, -2.5, 0.25], [1.0, -3.0, 0.125, 4.0]])
