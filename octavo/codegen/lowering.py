"""Lowering: point every octavo op of a graph at the chosen backend's kernel."""

from __future__ import annotations

import logging

import torch
from torch.fx import GraphModule

from octavo.errors import OctavoError

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "triton", "cpu")


def backend_kernels(backend: str) -> dict:
    """The octavo op -> kernel op table of `backend` ("torch", "triton" or "cpu")."""
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


def prepare_hooks(backend: str) -> dict:
    """octavo op -> `prepare(node)`, for the kernels of `backend` that do work per node at load."""
    if backend == "triton":
        from octavo.codegen.triton_backend.kernel_table import PREPARE_HOOKS

        return PREPARE_HOOKS
    return {}


def native_quantized_kernels(backend: str) -> dict:
    """Quantized layout -> `backend`'s own linear kernel for it (used instead of weight_packing's kernels)."""
    if backend == "cpu":
        from octavo.codegen.cpu_backend.kernel_table import native_quantized_kernels as cpu_kernels

        return cpu_kernels()
    return {}


def native_bf16_linear(backend: str):
    """`backend`'s own kernel for bfloat16 linears (aten.linear's arguments), or None where it has none."""
    if backend == "cpu":
        from octavo.codegen.cpu_backend.kernel_table import native_bf16_linear as cpu_kernel

        return cpu_kernel()
    return None


def lower_graph(graph_module: GraphModule, backend: str, activation_dtype: torch.dtype | None = None,
                int8_activations: bool = False) -> GraphModule:
    """Replace each octavo op node's target by the backend's kernel op (in place); ATen ops stay as they are.

    Every kernel is an OpOverload (a custom op of the backend's namespace, or
    a reference octavo op that is its own kernel), so the lowered graph runs
    eagerly or through torch.compile/export alike. Fails naming the op when
    the backend lacks a kernel for it. A backend's `prepare(node)` hook runs
    once per node here, at load (the Triton backend generates and imports
    fused_pointwise kernels then). First, on the CPU backends, quantized
    linears get their CPU kernel and packed weights
    (torch_backend.weight_packing; `activation_dtype` is the artifact's
    dtype, float32 when not given); the cpu backend's w8 and w4 linears
    call its own kernels, and so do its bfloat16 linears
    (weight_packing.route_bf16_linears). `int8_activations` (a w8a8
    artifact): its w8 linears round their inputs to int8 (weight_packing);
    only the CPU backends have kernels for that, so another backend is
    refused.
    """
    if int8_activations and backend not in ("torch", "cpu"):
        raise OctavoError(f"a w8a8 artifact (int8 activations) runs on the cpu and torch backends; {backend} has no "
                          "int8-activation linear: compile with --quant w8 for it")
    if backend in ("torch", "cpu"):  # cpu packs like torch, except the layouts it has its own kernels for
        from octavo.codegen.torch_backend.weight_packing import pack_quantized_linears, route_bf16_linears

        pack_quantized_linears(graph_module, activation_dtype, native_kernels=native_quantized_kernels(backend),
                               int8_activations=int8_activations)
        bf16_kernel = native_bf16_linear(backend)
        if bf16_kernel is not None:
            route_bf16_linears(graph_module, bf16_kernel)
    kernels = backend_kernels(backend)
    hooks = prepare_hooks(backend)
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target.namespace != "octavo":
            continue
        if node.target not in kernels:
            raise OctavoError(f"backend {backend} has no kernel for {node.target}")
        kernel = kernels[node.target]
        if not isinstance(kernel, torch._ops.OpOverload):
            raise OctavoError(f"backend {backend}: the kernel of {node.target} is not a registered op")
        if node.target in hooks:
            hooks[node.target](node)
        node.target = kernel
    graph_module.recompile()
    return graph_module
