"""Lowering: point every octavo op of a graph at the chosen backend's kernel."""

from __future__ import annotations

import logging

import torch
from torch.fx import GraphModule

from octavo.errors import OctavoError

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "triton", "cpu")


def backend_kernels(backend: str) -> dict:
    """The op -> kernel table of `backend` ("torch", "triton" or "cpu")."""
    if backend == "torch":
        from octavo.codegen.torch_backend import KERNELS

        return KERNELS
    if backend == "triton":
        from octavo.codegen.triton_backend import KERNELS

        return KERNELS
    if backend == "cpu":
        from octavo.codegen.cpu_backend import KERNELS

        return KERNELS
    raise OctavoError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")


def lower_graph(graph_module: GraphModule, backend: str, activation_dtype: torch.dtype | None = None) -> GraphModule:
    """Replace each octavo op node's target by the backend kernel (in place); ATen ops stay as they are.

    Fails naming the op when the backend lacks a kernel for it. A kernel with
    a `prepare(node)` attribute gets it called once per node here, at load
    (the Triton backend generates and imports fused_pointwise kernels then).
    First, on the CPU backends, quantized linears get their CPU kernel and
    packed weights (torch_backend.weight_packing; `activation_dtype` is the
    artifact's dtype, float32 when not given).
    """
    if backend in ("torch", "cpu"):  # the cpu backend runs the torch backend's quantized linears
        from octavo.codegen.torch_backend.weight_packing import pack_quantized_linears

        pack_quantized_linears(graph_module, activation_dtype)
    kernels = backend_kernels(backend)
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target.namespace != "octavo":
            continue
        if node.target not in kernels:
            raise OctavoError(f"backend {backend} has no kernel for {node.target}")
        kernel = kernels[node.target]
        if hasattr(kernel, "prepare"):
            kernel.prepare(node)
        node.target = kernel
    graph_module.recompile()
    return graph_module
