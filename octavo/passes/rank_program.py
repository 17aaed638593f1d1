"""One rank's program of a parallel layout, made at load time from an unsharded artifact.

The artifact holds the whole model; the parallel passes (shard_tensor_parallel,
split_pipeline_stages) run when an engine of a given size loads it, so one
artifact serves every tensor and pipeline parallel size. The loaded graph
carries no shapes (graph.onnx stores none), so they are first re-derived
with fake tensors from the manifest's signature and the weights' shapes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule

from octavo.config import CompileConfig, RankPosition
from octavo.errors import PassError
from octavo.passes.context import PassContext
from octavo.passes.manager import run_pipeline

logger = logging.getLogger(__name__)

PARALLEL_PIPELINE = ["shard_tensor_parallel", "split_pipeline_stages"]


@dataclass
class RankProgram:
    """What one rank runs: its graph, its weight slices, its KV layout and, with PP, its stage's boundary."""

    position: RankPosition
    graph_module: GraphModule
    weights: dict[str, torch.Tensor]
    kv_layout: dict
    pipeline_stage: dict | None
    history: list[dict]
    seconds: float


def prepare_rank_program(graph_module: GraphModule, weights: dict[str, torch.Tensor], manifest: dict,
                         position: RankPosition) -> RankProgram:
    """Run the parallel passes for `position` on a copy of the artifact's graph (the artifact is not changed).

    `weights` are the artifact's tensors (memory-mapped views); the result's
    weights are this rank's slices, the other ones are never read.
    """
    start = time.perf_counter()
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    copy = GraphModule(torch.nn.Module(), graph)
    ctx = load_time_context(copy, dict(weights), manifest, position)
    result = run_pipeline(copy, ctx, PARALLEL_PIPELINE)
    seconds = time.perf_counter() - start
    logger.info("rank %d (tp %d/%d, pp %d/%d): program prepared in %.2fs", position.rank, position.tp_rank,
                position.tp_size, position.pp_rank, position.pp_size, seconds)
    return RankProgram(position, result, ctx.weights, ctx.kv_layout, ctx.pipeline_stage, ctx.history, seconds)


def load_time_context(graph_module: GraphModule, weights: dict[str, torch.Tensor], manifest: dict,
                      position: RankPosition) -> PassContext:
    """A PassContext for a loaded graph whose placeholders carry fake tensors of concrete example sizes.

    Symbolic sizes cost milliseconds of sympy per node (a 30-layer model takes
    many seconds per rank); a fake mode without a shape environment, at fixed
    example sizes, costs a small fraction of that. The runtime sizes (T, B,
    N, ...) get values no model dimension has (LOAD_TIME_SIZES), so that
    ctx.symbol_names() still tells a size that is the token count from a
    constant.
    """
    layout = manifest["kv_layout"]
    ctx = PassContext(config=CompileConfig(dtype=manifest["dtype"], block_size=layout["block_size"]),
                      weights=weights, model_config=manifest.get("source", {}).get("config"), architecture=None,
                      fake_mode=FakeTensorMode(), symbols=dict(LOAD_TIME_SIZES), kv_layout=dict(layout),
                      rank=position)
    signature = manifest["signature"]["inputs"]
    for node in graph_module.graph.find_nodes(op="placeholder"):
        if node.name in weights:
            shape, dtype = weights[node.name].shape, weights[node.name].dtype
        elif node.name in signature:
            spec = signature[node.name]
            shape, dtype = [_example_size(dim) for dim in spec["shape"]], getattr(torch, spec["dtype"])
            ctx.runtime_inputs[node.name] = spec
        else:
            raise PassError(f"graph input {node.name} is neither a weight nor an input of the manifest's signature")
        with ctx.fake_mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype)
    return ctx


LOAD_TIME_SIZES = {"T": 1009, "B": 1013, "N": 1019, "max_blocks": 1021, "num_blocks": 1031}
"""Example runtime sizes for load-time shape propagation: primes no model dimension is."""


def _example_size(dim: int | str) -> int:
    if isinstance(dim, int):
        return dim
    name, _, offset = dim.replace(" ", "").partition("+")
    return LOAD_TIME_SIZES[name] + (int(offset) if offset else 0)
