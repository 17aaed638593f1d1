"""The Triton kernel sources of a graph: written into the artifact's kernels/, re-derived and compared at load.

Works without Triton (it only produces text), so CPU-only machines write
the same kernels/ directory as GPU machines. Template kernels are the
files of this package that implement the graph's ops; fused_pointwise
nodes get their generated kernel, one file per distinct program.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from torch.fx import GraphModule, Node

from octavo.codegen.triton_backend.op_table import TRITON_OPS
from octavo.codegen.triton_backend.pointwise_codegen import generate_source, kernel_name
from octavo.errors import OctavoError

logger = logging.getLogger(__name__)

_PACKAGE_DIR = Path(__file__).resolve().parent


def kernel_sources(graph_module: GraphModule) -> dict[str, str]:
    """file name -> source text of every Triton kernel the graph's octavo ops run, sorted by name."""
    sources: dict[str, str] = {}
    for node in graph_module.graph.nodes:
        op = octavo_op_name(node)
        if op == "fused_pointwise":
            program = fused_program(node)
            sources[f"{kernel_name(program)}.py"] = generate_source(program)
        elif op in TRITON_OPS:
            for file in TRITON_OPS[op].template_files:
                sources[file] = template_source(file)
    return dict(sorted(sources.items()))


def source_hashes(sources: dict[str, str]) -> dict[str, str]:
    """file name -> sha256 of its text (UTF-8), as the manifest's "kernels" lists them."""
    return {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(sources.items())}


def check_kernel_sources(graph_module: GraphModule, manifest: dict) -> list[str]:
    """Re-derive the graph's kernel sources with this Octavo and compare with manifest["kernels"].

    Each kernel that differs, is missing, or is new is reported as a logged
    warning (the artifact was compiled by another code generator version;
    the installed one is what runs). Returns the names of those kernels.
    """
    recorded = manifest.get("kernels", {})
    try:
        current = source_hashes(kernel_sources(graph_module))
    except OctavoError as error:
        logger.warning("cannot regenerate the graph's Triton kernels (%s); the triton backend cannot run it", error)
        return sorted(recorded)
    mismatched = [name for name in sorted(set(recorded) | set(current)) if recorded.get(name) != current.get(name)]
    if mismatched:
        details = ", ".join(f"{name} ({_mismatch_reason(name, recorded, current)})" for name in mismatched)
        logger.warning("%d Triton kernel source(s) differ from the artifact's manifest: %s; the artifact was "
                       "compiled by another code generator version, and this Octavo runs its own regenerated "
                       "kernels", len(mismatched), details)
    return mismatched


def _mismatch_reason(name: str, recorded: dict, current: dict) -> str:
    if name not in current:
        return "not generated for this graph any more"
    if name not in recorded:
        return "not in the manifest"
    return "changed"


def write_kernel_sources(directory: str | Path, sources: dict[str, str]) -> None:
    """Write one file per kernel into `directory` (created), e.g. a dump dir's kernels/."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        (directory / name).write_text(text, encoding="utf-8")


def template_source(file: str) -> str:
    """The text of one template kernel file of this package."""
    return (_PACKAGE_DIR / file).read_text(encoding="utf-8")


def octavo_op_name(node: Node) -> str | None:
    """"paged_attention" for a call of torch.ops.octavo.paged_attention.<overload>, else None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "octavo":
        return None
    return target.name().split("::", 1)[1].split(".", 1)[0]


def fused_program(node: Node) -> str:
    """The program string of a fused_pointwise node."""
    return node.args[1] if len(node.args) > 1 else node.kwargs["program"]
