"""Calibration runner: the traced float graph executed on calibration text, recording what its linears read.

The graph is the one torch.export traced (before any pass): placeholders ``input_ids`` [T],
``positions`` [T] and the weights. Each calibration run is one flat sequence (positions
0..T-1, causal attention as traced), run eagerly node by node up to the last input to record
(the lm_head's: the logits are never computed). For every ``aten.linear``
whose weight is a weight placeholder, the rows of its input are added to a
LinearInputStats; linears that read the same input node (q, k and v; gate and up) share
one object. The result maps each such linear's weight placeholder name to its stats.

Sequential mode (``replace_weight`` given, what GPTQ's paper does): every run advances
together, node by node in graph order, so when the first linear reading a weight is reached,
the statistics of its input over every run are complete. ``replace_weight(name, weight,
stats)`` is called then, once per weight, and the value it returns (the quantized weight,
dequantized) is what that linear and everything after it use in every run. The statistics
of a linear's input are thereby those of the model whose earlier linears are already
replaced (q, k, v are replaced before the attention output reaches o_proj, and so on).
The lm_head is never executed, so never replaced. Holds every run's live values at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.fx import GraphModule, Interpreter, Node
from tqdm.auto import tqdm

from octavo.ir.linear_input_stats import LinearInputStats

aten = torch.ops.aten

WeightReplacer = Callable[[str, torch.Tensor, LinearInputStats], torch.Tensor]


def collect_linear_inputs(graph_module: GraphModule, weights: dict[str, torch.Tensor], runs: list[list[int]],
                          progress: bool = False,
                          replace_weight: WeightReplacer | None = None) -> dict[str, LinearInputStats]:
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
    if replace_weight is not None:
        _run_sequentially(graph_module, weights, runs, by_input, replace_weight, progress)
        return by_weight
    recorder = _InputRecorder(graph_module, by_input)
    placeholders = [node.name for node in graph_module.graph.find_nodes(op="placeholder")]
    with torch.no_grad():
        for run in tqdm(runs, desc="calibrating", unit="run", disable=not progress):
            with contextlib.suppress(_AllRecordedError):
                recorder.run(*[value for _, value in _placeholder_values(placeholders, run, weights)])
    return by_weight


def _placeholder_values(placeholders: list[str], run: list[int], weights: dict[str, torch.Tensor]):
    inputs = {"input_ids": torch.tensor(run, dtype=torch.long), "positions": torch.arange(len(run))}
    return [(name, inputs[name] if name in inputs else weights[name]) for name in placeholders]


def _run_sequentially(graph_module: GraphModule, weights: dict[str, torch.Tensor], runs: list[list[int]],
                      watched: dict[Node, LinearInputStats], replace_weight: WeightReplacer, progress: bool) -> None:
    """Sequential mode (see the module docstring): every run advances one node at a time."""
    if not watched:
        return
    order = {node: index for index, node in enumerate(graph_module.graph.nodes)}
    last = max(watched, key=order.__getitem__)
    interpreters = [Interpreter(graph_module) for _ in runs]
    placeholders = {node.name: node for node in graph_module.graph.find_nodes(op="placeholder")}
    for interpreter, run in zip(interpreters, runs, strict=True):
        for name, value in _placeholder_values(list(placeholders), run, weights):
            interpreter.env[placeholders[name]] = value
    replaced: set[Node] = set()
    nodes = [node for node in graph_module.graph.nodes if node.op != "placeholder" and order[node] <= order[last]]
    with torch.no_grad():
        for node in tqdm(nodes, desc="calibrating", unit="node", disable=not progress):
            weight = node.args[1] if node.target is aten.linear.default and len(node.args) > 1 else None
            if isinstance(weight, Node) and weight not in replaced and node.args[0] in watched \
                    and weight.op == "placeholder" and weight.name in weights:
                value = replace_weight(weight.name, interpreters[0].env[weight], watched[node.args[0]])
                for interpreter in interpreters:
                    interpreter.env[weight] = value
                replaced.add(weight)
            for interpreter in interpreters:
                interpreter.env[node] = interpreter.run_node(node)
                if node in watched:
                    watched[node].add(interpreter.env[node])
                for dead in interpreter.user_to_last_uses.get(node, []):
                    del interpreter.env[dead]


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
