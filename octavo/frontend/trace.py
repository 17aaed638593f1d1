"""Tracing: torch.export of a HF causal LM into a flat-token FX graph.

The traced program takes ``input_ids`` [T] and ``positions`` [T] (batch 1,
T symbolic) and returns logits [T, vocab]. Every weight, buffer and lifted
constant becomes a placeholder named after its module path
(``model.layers.0.self_attn.q_proj.weight`` -> ``model_layers_0_self_attn_q_proj_weight``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Graph, GraphModule

from octavo.errors import OctavoError
from octavo.frontend.rope_compat import traceable_longrope
from octavo.frontend.sources import ModelSource
from octavo.frontend.token_guards import MIN_NUM_TOKENS, check_token_dimension
from octavo.ir.graph_inputs import TOKEN_INPUTS

logger = logging.getLogger(__name__)

EXAMPLE_NUM_TOKENS = 11
_WRAPPER_PREFIX = "model."


@dataclass
class TracedModel:
    """The exported graph, its weights by placeholder name, and the fake mode of its metadata."""

    graph_module: GraphModule
    weights: dict[str, torch.Tensor]
    weight_sources: dict[str, str]
    fake_mode: object
    num_tokens: torch.SymInt
    program: torch.export.ExportedProgram | None = None

    def copy(self) -> TracedModel:
        """A fresh graph over the same exported program (weights shared: passes replace tensors, never write them)."""
        if self.program is None:
            raise OctavoError("this traced model keeps no exported program to copy")
        return _rename_inputs(self.program)


class _FlatTokenCausalLM(torch.nn.Module):
    """Runs a HF causal LM on one flat "sequence" of tokens with explicit positions."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        output = self.model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                            use_cache=False)
        return output.logits[0]


def trace(source: ModelSource, dtype: str) -> TracedModel:
    """Load `source`'s weights in `dtype` and export it; see the module docstring for the graph's form."""
    module = source.load_module(dtype)
    return trace_module(module)


def trace_module(module: torch.nn.Module) -> TracedModel:
    """Export an already loaded HF causal LM (used by `trace` and by tests with random weights)."""
    wrapper = _FlatTokenCausalLM(module).eval()
    vocab_size = module.config.vocab_size
    example = (torch.randint(0, vocab_size, (EXAMPLE_NUM_TOKENS,)), torch.arange(EXAMPLE_NUM_TOKENS))
    # A DYNAMIC dimension, not a named strict Dim: a strict Dim fails export on any guard that torch cannot
    # prove for every T, and some releases (2.11) cannot prove true ones such as min(16*T, 32*T) == 16*T.
    # The guards are checked below instead, so that a program specialized to some token counts is still refused.
    num_tokens = Dim.DYNAMIC(min=MIN_NUM_TOKENS)
    try:
        with torch.no_grad(), traceable_longrope(module):
            program = torch.export.export(
                wrapper, example, dynamic_shapes={name: {0: num_tokens} for name in TOKEN_INPUTS}, strict=False)
    except Exception as error:
        raise OctavoError(f"torch.export failed for model_type {module.config.model_type!r}: "
                          f"{str(error).splitlines()[0]}") from error
    check_token_dimension(program, module.config.model_type)
    return _rename_inputs(program.run_decompositions({}))


def _rename_inputs(program: torch.export.ExportedProgram) -> TracedModel:
    """Copy the exported graph into a plain GraphModule whose placeholders carry weight names."""
    old_graph = program.graph_module.graph
    new_graph = Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    weights: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    placeholders = {node.name: node for node in old_graph.nodes if node.op == "placeholder"}
    # Tied weights (lm_head = embed_tokens) are one tensor behind two placeholders: keep one.
    by_storage: dict[tuple, torch.fx.Node] = {}
    for spec in program.graph_signature.input_specs:
        old = placeholders[spec.arg.name]
        if spec.kind == InputKind.USER_INPUT:
            name = spec.arg.name
        else:
            value = _weight_value(program, spec)
            key = (value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
            if key in by_storage and value.numel() > 0:
                env[old] = by_storage[key]
                continue
            name = _unique_identifier(_weight_name(spec.target), weights)
            weights[name] = value
            sources[name] = spec.target.removeprefix(_WRAPPER_PREFIX)
        new = new_graph.placeholder(name)
        if spec.kind != InputKind.USER_INPUT:
            by_storage[key] = new
        new.meta = dict(old.meta)
        env[old] = new
    for node in old_graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            # Buffers the model updates in place (longrope's inv_freq) are outputs too: only the logits stay.
            kinds = [spec.kind for spec in program.graph_signature.output_specs]
            (logits,) = [value for value, kind in zip(node.args[0], kinds, strict=True)
                         if kind == OutputKind.USER_OUTPUT]
            new_graph.output(env[logits])
            continue
        env[node] = new_graph.node_copy(node, lambda n: env[n])
    graph_module = GraphModule(torch.nn.Module(), new_graph)
    fake_value = env[placeholders["input_ids"]].meta["val"]
    return TracedModel(graph_module, weights, sources, fake_value.fake_mode, fake_value.shape[0], program)


def _weight_value(program: torch.export.ExportedProgram, spec) -> torch.Tensor:
    if spec.target in program.state_dict:
        return program.state_dict[spec.target].detach()
    return program.constants[spec.target].detach()


def _weight_name(target: str) -> str:
    return re.sub(r"\W", "_", target.removeprefix(_WRAPPER_PREFIX))


def _unique_identifier(name: str, taken: dict) -> str:
    candidate, index = name, 1
    while candidate in taken or candidate in TOKEN_INPUTS:
        candidate, index = f"{name}_{index}", index + 1
    return candidate
