"""Calibration runner: the traced float graph executed on calibration text, recording what its linears read.

The graph is the one torch.export traced (before any pass): placeholders ``input_ids`` [T],
``positions`` [T] and the weights. Each calibration run is one flat sequence (positions
0..T-1, causal attention as traced), run eagerly node by node up to the last input to record
(the lm_head's: the logits are never computed). For every ``aten.linear``
whose weight is a weight placeholder, the rows of its input are added to a
LinearInputStats; linears that read the same input node (q, k and v; gate and up) share
one object. The result maps each such linear's weight placeholder name to its stats.
"""

from __future__ import annotations

import contextlib

import torch
from torch.fx import GraphModule, Interpreter, Node
from tqdm.auto import tqdm

from octavo.ir.linear_input_stats import LinearInputStats

aten = torch.ops.aten


def collect_linear_inputs(graph_module: GraphModule, weights: dict[str, torch.Tensor], runs: list[list[int]],
                          progress: bool = False) -> dict[str, LinearInputStats]:
    """Input statistics of every weight linear of `graph_module` over the token `runs` (see the module docstring)."""
    by_input: dict[Node, LinearInputStats] = {}
    by_weight: dict[str, LinearInputStats] = {}
    for node in graph_module.graph.find_nodes(op="call_function", target=aten.linear.default):
        weight = node.args[1]
        if isinstance(weight, Node) and weight.op == "placeholder" and weight.name in weights:
            source = node.args[0]
            if source not in by_input:
                by_input[source] = LinearInputStats(int(weights[weight.name].shape[1]))
            by_weight[weight.name] = by_input[source]
    recorder = _InputRecorder(graph_module, by_input)
    placeholders = [node.name for node in graph_module.graph.find_nodes(op="placeholder")]
    with torch.no_grad():
        for run in tqdm(runs, desc="calibrating", unit="run", disable=not progress):
            inputs = {"input_ids": torch.tensor(run, dtype=torch.long), "positions": torch.arange(len(run))}
            with contextlib.suppress(_AllRecordedError):
                recorder.run(*[inputs[name] if name in inputs else weights[name] for name in placeholders])
    return by_weight


class _AllRecordedError(Exception):
    """Raised once the last watched node is recorded: the rest of the graph (the logits) is not needed."""


class _InputRecorder(Interpreter):
    """Runs the graph eagerly; adds the value of each watched node to its stats."""

    def __init__(self, graph_module: GraphModule, watched: dict[Node, LinearInputStats]):
        super().__init__(graph_module)
        self.watched = watched
        order = {node: index for index, node in enumerate(graph_module.graph.nodes)}
        self.last = max(watched, key=order.__getitem__) if watched else None

    def run_node(self, node: Node):
        value = super().run_node(node)
        if node in self.watched:
            self.watched[node].add(value)
            if node is self.last:
                raise _AllRecordedError
        return value
