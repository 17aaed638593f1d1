"""Shared by the fusion pass tests: tiny models traced once, pipelines run on copies, graphs run on a paged batch.

A graph is run the way the runtime runs it (octavo ops lowered to the torch
backend) on three steps of a small batch: two prefills, then two decodes plus a
third sequence's prefill, then three decodes. Its result is every step's
logits for every token row and the final KV cache contents, so that "same
outputs" compares everything the graph computes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule

from octavo.codegen.lowering import lower_graph
from octavo.config import CompileConfig
from octavo.frontend.architectures import architecture_for
from octavo.frontend.trace import TracedModel, trace_module
from octavo.ir.graph import count_ops, op_histogram
from octavo.passes import PassContext, run_pipeline
from octavo.runtime.kv_cache import pool_shapes
from tests.tiny_models import make_tiny_model

BASE_PASSES = ["canonicalize", "match_attention", "prune_logits", "match_moe"]
FUSION_PASSES = ["fuse_rms_norm", "fuse_add_rms_norm", "fuse_qkv", "fuse_gate_up", "fuse_activation", "fuse_rope",
                 "fuse_pointwise"]
ALL_PASSES = BASE_PASSES + FUSION_PASSES
MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BLOCK_SIZE = 16
BLOCKS_PER_SEQUENCE = 4
# (sequence, number of new tokens) per step; sequences continue where they stopped.
STEPS = [[(0, 13), (1, 7)], [(0, 1), (1, 1), (2, 5)], [(0, 1), (1, 1), (2, 1)]]


@functools.cache
def traced_model(model_type: str, dtype: str) -> tuple[torch.nn.Module, TracedModel]:
    """A tiny random-weight model of `model_type` in `dtype`, traced once per test process."""
    model = make_tiny_model(model_type).to(DTYPES[dtype])
    return model, trace_module(model)


@dataclass
class Compiled:
    """A graph after a list of passes, with the context (weights, stats) the passes left."""

    graph_module: GraphModule
    ctx: PassContext

    def stats(self, pass_name: str) -> dict:
        return next(record["stats"] for record in self.ctx.history if record["name"] == pass_name)

    def count(self, op: str) -> int:
        return count_ops(self.graph_module, op)

    def histogram(self) -> dict[str, int]:
        return op_histogram(self.graph_module)


def passes_through(name: str) -> tuple[str, ...]:
    """The default pipeline up to and including pass `name`."""
    return tuple(ALL_PASSES[: ALL_PASSES.index(name) + 1])


def passes_before(name: str) -> tuple[str, ...]:
    """The default pipeline up to, not including, pass `name`."""
    return tuple(ALL_PASSES[: ALL_PASSES.index(name)])


def compile_graph(model_type: str, dtype: str, passes, disabled: tuple[str, ...] = ()) -> Compiled:
    """Run `passes` (minus `disabled`) on a fresh copy of the traced tiny model."""
    model, traced = traced_model(model_type, dtype)
    return compile_traced(model, traced, dtype, passes, disabled)


def compile_traced(model, traced: TracedModel, dtype: str, passes, disabled: tuple[str, ...] = ()) -> Compiled:
    """Run `passes` (minus `disabled`) on a fresh copy of `traced`, the trace of `model`."""
    ctx = PassContext(config=CompileConfig(dtype=dtype, disabled_passes=disabled), weights=dict(traced.weights),
                      model_config=model.config, architecture=architecture_for(model.config),
                      fake_mode=traced.fake_mode, symbols={"T": traced.num_tokens})
    graph_module = run_pipeline(clone_graph(traced.graph_module), ctx, list(passes))
    return Compiled(graph_module, ctx)


@functools.cache
def compiled(model_type: str, dtype: str, passes: tuple[str, ...], disabled: tuple[str, ...] = ()) -> Compiled:
    """compile_graph, cached per process: shared by tests, which must not modify it."""
    return compile_graph(model_type, dtype, passes, disabled)


@functools.cache
def outputs(model_type: str, dtype: str, passes: tuple[str, ...], disabled: tuple[str, ...] = ()) -> tuple:
    """run_steps of the cached compiled graph."""
    return tuple(run_steps(compiled(model_type, dtype, passes, disabled)))


def clone_graph(graph_module: GraphModule) -> GraphModule:
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    return GraphModule(torch.nn.Module(), graph)


def run_steps(compiled: Compiled, graph_module: GraphModule | None = None,
              weights: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every step's logits (all token rows) then every KV cache, from running the graph on STEPS.

    `graph_module`/`weights` default to the compiled ones (a re-imported copy
    of the graph can be run with the compiled weights).
    """
    layout = compiled.ctx.kv_layout
    lowered = lower_graph(clone_graph(graph_module or compiled.graph_module), "torch")
    weights = weights or compiled.ctx.weights
    num_blocks = BLOCKS_PER_SEQUENCE * 3
    # Every pool the layout names: the caches, and their scale pools when the cache is quantized.
    caches = {name: torch.zeros(num_blocks, *shape, dtype=dtype)
              for name, (shape, dtype) in pool_shapes(layout).items()}
    generator = torch.Generator().manual_seed(0)
    lengths = [0, 0, 0]
    results = []
    for step in STEPS:
        inputs = step_inputs(step, lengths, generator)
        inputs.update(caches)
        arguments = [weights[node.name] if node.name in weights else inputs[node.name]
                     for node in lowered.graph.nodes if node.op == "placeholder"]
        with torch.inference_mode():
            results.append(lowered(*arguments))
    return results + [caches[name] for name in sorted(caches)]


def step_inputs(step: list[tuple[int, int]], lengths: list[int], generator: torch.Generator) -> dict:
    """Runtime inputs for one step of (sequence, new tokens); advances `lengths`."""
    positions, slots, seq_lens, starts = [], [], [], [0]
    tables = torch.arange(3 * BLOCKS_PER_SEQUENCE, dtype=torch.int32).view(3, BLOCKS_PER_SEQUENCE)
    for sequence, count in step:
        new = range(lengths[sequence], lengths[sequence] + count)
        positions.extend(new)
        slots.extend(int(tables[sequence, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in new)
        lengths[sequence] += count
        seq_lens.append(lengths[sequence])
        starts.append(starts[-1] + count)
    num_tokens = starts[-1]
    return {
        "input_ids": torch.randint(3, 49000, (num_tokens,), generator=generator),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "block_tables": tables[[sequence for sequence, _ in step]].contiguous(),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "logits_indices": torch.arange(num_tokens, dtype=torch.int64),
    }


def assert_bitwise_equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> None:
    assert len(first) == len(second)
    for index, (a, b) in enumerate(zip(first, second, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, (index, a.dtype, b.dtype, a.shape, b.shape)
        if not torch.equal(a, b):
            difference = (a.float() - b.float()).abs().max().item()
            raise AssertionError(f"output {index} differs (max abs difference {difference})")


def make_graph(function, inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
               model_type: str = "test") -> tuple[GraphModule, PassContext]:
    """Trace `function(*inputs, *weights)` (by value order) to an ATen graph with a PassContext around it.

    For pass tests on hand-written patterns: placeholders of `weights` become
    ctx.weights entries; meta["val"] holds fake tensors, as the manager keeps it.
    """
    from types import SimpleNamespace

    from torch.fx.experimental.proxy_tensor import make_fx

    values = [*inputs.values(), *weights.values()]
    graph_module = make_fx(function, tracing_mode="fake")(*values)
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    weight_nodes = placeholders[len(inputs):]
    fake_mode = placeholders[0].meta["val"].fake_mode
    ctx = PassContext(config=CompileConfig(), weights={node.name: value for node, value in
                                                       zip(weight_nodes, weights.values(), strict=True)},
                      model_config=SimpleNamespace(model_type=model_type, max_position_embeddings=64),
                      architecture=SimpleNamespace(model_type=model_type), fake_mode=fake_mode, symbols={})
    return graph_module, ctx


def run_plain(graph_module: GraphModule, ctx: PassContext, inputs: dict[str, torch.Tensor]):
    """Run a make_graph graph (lowered to the torch backend) on `inputs` and its weights."""
    lowered = lower_graph(clone_graph(graph_module), "torch")
    values = iter(inputs.values())
    arguments = [ctx.weights[node.name] if node.name in ctx.weights else next(values)
                 for node in lowered.graph.nodes if node.op == "placeholder"]
    with torch.no_grad():
        return lowered(*arguments)
