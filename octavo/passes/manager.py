"""The pass manager: runs a pipeline, verifies and re-annotates the graph after every pass, writes dumps."""

from __future__ import annotations

import difflib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from torch.fx import GraphModule
from tqdm.auto import tqdm

from octavo.errors import OctavoError, PassError
from octavo.ir.graph import format_graph, op_histogram, verify_graph
from octavo.passes.context import PassContext
from octavo.passes.registry import PassInfo, resolve_pipeline
from octavo.passes.shape_propagation import adopt_traced_values, check_full_propagation, propagate_changed

logger = logging.getLogger(__name__)


def run_pipeline(graph_module: GraphModule, ctx: PassContext, pipeline: str | list[str] = "default",
                 on_print_ir: Callable[[str, str], None] | None = None) -> GraphModule:
    """Run the passes of `pipeline` (minus ctx.config.disabled_passes) in order.

    After each pass: lint + op-set check, shape re-propagation with fake
    tensors of the nodes the pass changed (octavo.passes.shape_propagation),
    a history record in ctx.history (stats, time, node count, op histogram)
    and, when ctx.config.dump_dir is set, the dump files NN-<pass>.txt /
    .json / .diff. After the last pass, one full re-propagation checks every
    node's shape and dtype. Stops after ctx.config.stop_after.
    """
    passes = resolve_pipeline(pipeline, ctx.config.disabled_passes, ctx.config)
    _check_pass_names(ctx, passes)
    start = time.perf_counter()
    adopt_traced_values(graph_module, ctx.fake_mode)
    ctx.propagation_timings["initial_s"] = round(time.perf_counter() - start, 4)
    dumper = GraphDumper(Path(ctx.config.dump_dir)) if ctx.config.dump_dir else None
    if dumper:
        dumper.write(0, "traced", graph_module, ctx, {"description": "the graph as torch.export traced it"})
    for index, info in enumerate(tqdm(passes, desc="passes", disable=not ctx.config.progress, unit="pass"), 1):
        graph_module = _run_one(graph_module, ctx, info)
        record = ctx.history[-1]
        record["index"] = index
        logger.info("pass %s: %s (%.2fs)", info.name, record["stats"], record["time_s"])
        if dumper:
            dumper.write(index, info.name, graph_module, ctx, record)
        if on_print_ir and info.name in ctx.config.print_ir_after:
            on_print_ir(info.name, format_graph(graph_module, ctx.symbol_names()))
        if info.name == ctx.config.stop_after:
            break
    graph_module.recompile()  # once: the passes read and rewrite the graph, never the generated code
    start = time.perf_counter()
    check_full_propagation(graph_module, ctx.fake_mode)
    ctx.propagation_timings["final_check_s"] = round(time.perf_counter() - start, 4)
    return graph_module


def _run_one(graph_module: GraphModule, ctx: PassContext, info: PassInfo) -> GraphModule:
    ctx.stats = {}
    nodes_before = len(graph_module.graph.nodes)
    start = time.perf_counter()
    try:
        graph_module = info.function(graph_module, ctx)
    except OctavoError:
        raise
    except Exception as error:
        raise PassError(f"pass {info.name} failed: {type(error).__name__}: {error}") from error
    elapsed = time.perf_counter() - start
    start = time.perf_counter()
    verify_graph(graph_module)
    recomputed = propagate_changed(graph_module, ctx.fake_mode)
    ctx.history.append({
        "name": info.name,
        "description": info.description,
        "stats": dict(ctx.stats),
        "time_s": round(elapsed, 4),
        "verify_s": round(time.perf_counter() - start, 4),
        "nodes_repropagated": recomputed,
        "nodes_before": nodes_before,
        "nodes_after": len(graph_module.graph.nodes),
        "op_histogram": op_histogram(graph_module),
    })
    return graph_module


def _check_pass_names(ctx: PassContext, passes: list[PassInfo]) -> None:
    names = {info.name for info in passes}
    for option, value in (("--stop-after", [ctx.config.stop_after] if ctx.config.stop_after else []),
                          ("--print-ir-after", ctx.config.print_ir_after)):
        for name in value:
            if name not in names:
                raise PassError(f"{option} {name}: not a pass of this pipeline ({', '.join(sorted(names))})")


class GraphDumper:
    """Writes NN-<name>.txt (readable graph), .json (stats) and .diff (against the previous dump)."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.previous_text = ""
        self.previous_name = ""

    def write(self, index: int, name: str, graph_module: GraphModule, ctx: PassContext, record: dict) -> None:
        stem = f"{index:02d}-{name}"
        text = format_graph(graph_module, ctx.symbol_names())
        (self.directory / f"{stem}.txt").write_text(text)
        summary = {key: value for key, value in record.items() if key != "op_histogram"}
        summary["op_histogram"] = op_histogram(graph_module)
        summary["node_count"] = len(graph_module.graph.nodes)
        (self.directory / f"{stem}.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        if index > 0:
            diff = difflib.unified_diff(self.previous_text.splitlines(keepends=True), text.splitlines(keepends=True),
                                        fromfile=self.previous_name, tofile=stem)
            (self.directory / f"{stem}.diff").write_text("".join(diff))
        self.previous_text, self.previous_name = text, stem
