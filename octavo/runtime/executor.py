"""GraphExecutor: the artifact's graph with weights bound and kernels lowered, run once per step."""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from octavo.codegen.lowering import lower_graph


def bind_weights(graph_module: GraphModule, weights: dict[str, torch.Tensor], device: torch.device) -> GraphModule:
    """Turn weight placeholders into attributes of the module, so a step only passes runtime inputs."""
    graph = graph_module.graph
    first_compute = next(node for node in graph.nodes if node.op != "placeholder")
    for node in list(graph.nodes):
        if node.op != "placeholder" or node.name not in weights:
            continue
        graph_module.register_buffer(node.name, weights[node.name].to(device), persistent=False)
        with graph.inserting_before(first_compute):
            attribute = graph.get_attr(node.name)
        node.replace_all_uses_with(attribute)
        graph.erase_node(node)
    graph_module.recompile()
    return graph_module


def int8_activations(manifest: dict) -> bool:
    """Whether the artifact's linears round their inputs to int8 at run time (``--quant w8a8``)."""
    return ((manifest.get("quantization") or {}).get("activations") or {}).get("dtype") == "int8"


class GraphExecutor:
    """Runs the lowered graph node by node from Python: `run(inputs)` feeds every runtime placeholder by name."""

    kind = "eager"

    def __init__(self, graph_module: GraphModule, weights: dict[str, torch.Tensor], backend: str,
                 device: torch.device, activation_dtype: torch.dtype | None = None, int8_activations: bool = False):
        self.device = device
        # Work on a copy: binding and lowering rewrite the graph, and the artifact may serve other engines.
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(graph_module.graph, {}))
        graph_module = bind_weights(GraphModule(torch.nn.Module(), graph), weights, device)
        self.graph_module = lower_graph(graph_module, backend, activation_dtype, int8_activations)
        self.input_names = [node.name for node in self.graph_module.graph.nodes if node.op == "placeholder"]

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        missing = [name for name in self.input_names if name not in inputs]
        if missing:
            raise KeyError(f"graph inputs not provided: {missing}")
        with torch.inference_mode():
            return self.graph_module(*[inputs[name] for name in self.input_names])
