"""At load: choose each quantized linear's CPU kernel for this machine and pack its weights for it.

The choice, measured on an AVX-512 (BF16, VNNI) Zen 5 and on the same machine with
ATEN_CPU_CAPABILITY=avx2 (decode shapes of SmolLM2, M = 1; scripts/measure_quantization.py):

- ATen's int8pack and int4pack matmuls are fast with bfloat16 activations (2-3x faster than
  a float32 GEMM) but take a scalar path with float32 ones (10-30x slower): so they run in
  bfloat16, and float32 activations are cast to bfloat16 for them, only where the CPU has
  native bfloat16 (AVX512_BF16 or AMX). int4pack is also slow without AVX-512 (5x slower
  than float32 on AVX2), so there w4 runs dequantized.
- Everything else (w8 with group-wise scales such as GGUF's Q8_0, fp8, w4 without AVX-512,
  and every layout when the activations are float16, or float32 without native bfloat16)
  runs ``linear_dequantized``: the weight is dequantized once here, into bfloat16 where the
  other kernels would compute in bfloat16 (half the bytes to read, the native dot products)
  and into the activation dtype otherwise; fp8 keeps its exact values (exact in either) and
  applies the per-channel scales to the result. Such a weight takes 2 or 4 bytes a value in
  memory, not the artifact's 1 (or half): the cpu backend's own kernels do not widen them.

The vocabulary projection (the graph's last linear, which produces the logits) is the
exception: with float32 activations it computes in float32 on its dequantized weight,
whatever the CPU. Its bfloat16 result would round the logits to 8 significant bits (steps
of 1/16 near a logit of 16), enough to tie and flip greedy choices (measured on SmolLM2:
"The" and "L" tied for the first token of an answer). Every other linear feeds a float32
residual stream through a norm, where a bfloat16 rounding is as harmless as in a bf16 model.

A backend with kernels of its own for some layouts (the cpu backend's octavo_cpu::linear_w8 /
w4 / fp8, which read the int8 / int4 / float8 weights in place and accumulate in float32, the
vocabulary projection included) passes them as ``native_kernels``: those linears keep their layout and
call that kernel, with the scales and offsets widened to float32 once here (exact). Its
decode-sized calls (up to 8 rows) compute in float32; above that it dequantizes tiles for a
GEMM, which runs in bfloat16 (``bf16_gemm``) where the CPU has native bfloat16, except for
the vocabulary projection, for the reason above: reported as "native (bfloat16)", else
"native (float32)".

A w8a8 artifact (``int8_activations``) rounds its linears' inputs to int8 at run time, in groups of
64 columns of a row: every w8 linear with one scale per output channel, except the one that produces
the logits (for the reason above), becomes the backend's own ``w8a8`` kernel over weights packed for
it by its ``w8a8_pack`` op (the cpu backend's octavo_cpu::linear_w8a8: vpdpbusd on AVX512_VNNI CPUs,
vpmaddubsw in the AVX2 build), else ``octavo_torch::linear_w8a8`` (the same definition in torch ops);
reported as "w8a8 (int8)". The other linears take the choice above.

``OCTAVO_CPU_QUANT_KERNEL=dequantized`` forces the dequantized kernel everywhere (for
comparisons). The choice is logged, and returned so the executor can report it.

bfloat16 linears (``aten.linear`` over a bound bfloat16 weight) of a backend with a kernel for
them (the cpu backend's octavo_cpu::linear_bf16: its own GEMV up to 8 rows, AMX tiles above where
the CPU has them, vdpbf16ps on AVX512_BF16 CPUs without) are pointed at it by ``route_bf16_linears``;
the weight stays the bound tensor (the kernel keeps one packed copy of it, made at its first call). By
default on CPUs that multiply bfloat16 natively under an AVX-512 ATen (``default_bf16_linear``);
``OCTAVO_CPU_BF16_LINEAR=native`` or ``aten`` decides on any CPU (``aten``: ATen's linear, which a
compiled graph prepacks for oneDNN).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
from torch._ops import OpOverload
from torch.fx import GraphModule, Node

from octavo.codegen.torch_backend.quantized_linear import INT4PACK_GROUP_SIZES, pack_int4, pack_int8
from octavo.ir.quantized_layout import dequantize_w4, dequantize_w8

logger = logging.getLogger(__name__)

FORCE_KERNEL_ENV = "OCTAVO_CPU_QUANT_KERNEL"
BF16_LINEAR_ENV = "OCTAVO_CPU_BF16_LINEAR"
octavo = torch.ops.octavo
octavo_torch = torch.ops.octavo_torch


@dataclass(frozen=True)
class CpuFeatures:
    """What the kernel choice depends on: ATen's vector ISA and native bfloat16 arithmetic."""

    avx512: bool
    native_bf16: bool

    @classmethod
    def detect(cls) -> CpuFeatures:
        capability = torch.backends.cpu.get_cpu_capability()
        avx512 = capability.startswith("AVX512")
        bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return cls(avx512=avx512, native_bf16=avx512 and bf16)

    def describe(self) -> str:
        return f"{'avx512' if self.avx512 else 'no avx512'}, {'native' if self.native_bf16 else 'no native'} bf16"


def choose_kernel(layout: str, group_size: int, in_features: int, activation_dtype: torch.dtype,
                  features: CpuFeatures, produces_logits: bool = False,
                  native_layouts: Collection[str] = (), int8_activations: bool = False) -> tuple[str, torch.dtype]:
    """(kernel, compute dtype) for one quantized linear; see the module docstring."""
    forced = os.environ.get(FORCE_KERNEL_ENV)
    if int8_activations and layout == "w8" and group_size >= in_features and not produces_logits:
        return "w8a8", torch.int8
    bf16_compute = activation_dtype == torch.bfloat16 or (
        activation_dtype == torch.float32 and features.native_bf16 and not produces_logits)
    if layout in native_layouts and forced != "dequantized":
        bf16_gemm = bf16_compute and features.native_bf16
        return "native", torch.bfloat16 if bf16_gemm else torch.float32
    if forced == "dequantized" or not bf16_compute:
        return "dequantized", activation_dtype
    if layout == "w8" and group_size >= in_features:
        return "int8pack", torch.bfloat16
    if layout == "w4" and group_size in INT4PACK_GROUP_SIZES and features.avx512:
        return "int4pack", torch.bfloat16
    return "dequantized", torch.bfloat16


def pack_quantized_linears(graph_module: GraphModule, activation_dtype: torch.dtype | None = None,
                           features: CpuFeatures | None = None,
                           native_kernels: Mapping[str, OpOverload] | None = None,
                           int8_activations: bool = False) -> Counter:
    """Rewrite every octavo.linear_w8/w4/fp8 node (weights bound as get_attr) into its chosen kernel.

    `native_kernels` maps layouts ("w8", "w4") to a backend's own kernels of the same
    arguments plus ``bf16_gemm``, and "w8a8" / "w8a8_pack" to its int8-activation linear and
    the op that packs its weights (see the module docstring). `int8_activations`: the
    artifact is w8a8.
    Returns how many linears got each "kernel (compute dtype)"; unused original weight
    buffers are dropped.
    """
    activation_dtype = activation_dtype or torch.float32
    features = features or CpuFeatures.detect()
    choices: Counter = Counter()
    targets = {octavo.linear_w8.default: "w8", octavo.linear_w4.default: "w4", octavo.linear_fp8.default: "fp8"}
    linears = [node for node in graph_module.graph.nodes if node.op == "call_function" and node.target in targets]
    for node in linears:
        if not _bound(node):
            continue  # weights passed as graph inputs cannot be packed: the node runs the reference op
        kernel, compute_dtype = _rewrite(graph_module, node, targets[node.target], activation_dtype, features,
                                         produces_logits=node is linears[-1], native_kernels=native_kernels or {},
                                         int8_activations=int8_activations)
        choices[f"{kernel} ({str(compute_dtype).removeprefix('torch.')})"] += 1
    if choices:
        _drop_unused_buffers(graph_module)
        graph_module.recompile()
        logger.info("quantized linears on this CPU (%s, %s activations): %s", features.describe(),
                    str(activation_dtype).removeprefix("torch."),
                    ", ".join(f"{count} {choice}" for choice, count in choices.items()))
    return choices


def route_bf16_linears(graph_module: GraphModule, kernel: OpOverload) -> int:
    """Point every aten.linear whose weight is a bound bfloat16 tensor at `kernel` (same arguments); the count.

    Nothing when OCTAVO_CPU_BF16_LINEAR is "aten"; unset, `default_bf16_linear` decides by the CPU. Any other
    value than "aten" or "native" is an error.
    """
    choice = os.environ.get(BF16_LINEAR_ENV) or default_bf16_linear()
    if choice not in ("native", "aten"):
        raise ValueError(f"{BF16_LINEAR_ENV} must be native or aten, got {choice!r}")
    if choice == "aten":
        return 0
    routed = 0
    for node in graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default):
        weight = node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if not _bound_bfloat16(graph_module, weight) or (bias is not None and not _bound_bfloat16(graph_module, bias)):
            continue
        node.target = kernel
        routed += 1
    if routed:
        graph_module.recompile()
        logger.info("bfloat16 linears on this CPU: %d to %s", routed, kernel)
    return routed


def default_bf16_linear(features: CpuFeatures | None = None) -> str:
    """"native" where ATen's vector ISA is AVX-512 and the CPU multiplies bfloat16 natively (AMX tiles or
    AVX512_BF16): there the kernel's GEMV and its GEMM (AMX tiles, else vdpbf16ps) both measured faster than
    oneDNN on the compiled graph's prepacked weights (benchmarks/RESULTS.md; on a Zen 5 without AMX the GEMV
    0.72x oneDNN's time at one row, the GEMM 0.70-0.93x at 16-256 rows). "aten" elsewhere: the kernel would widen
    every weight to float32 there, and its rows above the GEMV's would run ATen on an unpacked weight."""
    return "native" if (features or CpuFeatures.detect()).native_bf16 else "aten"


def _bound_bfloat16(graph_module: GraphModule, node: object) -> bool:
    return (isinstance(node, Node) and node.op == "get_attr"
            and getattr(graph_module, node.target).dtype == torch.bfloat16)


def _rewrite(graph_module: GraphModule, node: Node, layout: str, activation_dtype: torch.dtype,
             features: CpuFeatures, produces_logits: bool,
             native_kernels: Mapping[str, OpOverload], int8_activations: bool) -> tuple[str, torch.dtype]:
    x, weight_nodes, bias, group_size = _parse(node, layout)
    tensors = [_buffer(graph_module, weight) for weight in weight_nodes]
    qweight = tensors[0]
    in_features = 2 * qweight.shape[1] if layout == "w4" else qweight.shape[1]
    kernel, compute_dtype = choose_kernel(layout, group_size or in_features, in_features, activation_dtype, features,
                                          produces_logits, native_kernels.keys(), int8_activations)
    if kernel == "w8a8":
        packed, target, extra = _w8a8(tensors, native_kernels)
    elif kernel == "native":
        _widen_group_parameters(graph_module, node, weight_nodes[1:], tensors[1:])
        node.target = native_kernels[layout]
        node.args = (*node.args, compute_dtype == torch.bfloat16)
        return kernel, compute_dtype
    elif kernel == "int8pack":
        packed = pack_int8(*tensors, compute_dtype)
        target, extra = octavo_torch.linear_int8pack.default, ()
    elif kernel == "int4pack":
        packed = pack_int4(*tensors, group_size, compute_dtype)
        target, extra = octavo_torch.linear_int4pack.default, (group_size, qweight.shape[0])
    else:
        packed = _dequantized(layout, tensors, group_size, compute_dtype)
        packed.setdefault("column_scales", None)
        target, extra = octavo_torch.linear_dequantized.default, ()
    base = weight_nodes[0].target.removesuffix("_qweight")
    graph = graph_module.graph
    with graph.inserting_before(node):
        weights = [None if tensor is None else _attribute(graph_module, f"{base}_{kernel}_{role}", tensor)
                   for role, tensor in packed.items()]
        replacement = graph.call_function(target, (x, *weights, bias, *extra))
    replacement.meta = dict(node.meta)
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)
    return kernel, compute_dtype


def _w8a8(tensors: list[torch.Tensor], native_kernels: Mapping[str, OpOverload]) -> tuple[dict, OpOverload, tuple]:
    """(weights, kernel, trailing arguments) of a w8a8 linear: the backend's own kernel on its packing, else torch's."""
    qweight, scales = tensors
    scales = scales.float().reshape(-1).contiguous()
    if "w8a8" in native_kernels:
        packed = {"packed": native_kernels["w8a8_pack"](qweight), "scales": scales}
        return packed, native_kernels["w8a8"], tuple(qweight.shape)
    return {"qweight": qweight.contiguous(), "scales": scales}, octavo_torch.linear_w8a8.default, ()


def _widen_group_parameters(graph_module: GraphModule, node: Node, nodes: list[Node],
                            tensors: list[torch.Tensor]) -> None:
    """Point `node` at float32 copies of its scales / offsets (exact), so the kernel need not widen them per call."""
    graph = graph_module.graph
    for parameter_node, tensor in zip(nodes, tensors, strict=True):
        if tensor.dtype == torch.float32:
            continue
        with graph.inserting_before(node):
            widened = _attribute(graph_module, f"{parameter_node.target}_float32", tensor.float().contiguous())
        node.replace_input_with(parameter_node, widened)


def _parse(node: Node, layout: str) -> tuple[Node, list[Node], Node | None, int | None]:
    """(x, weight nodes, bias, group_size) of a linear_w8 / linear_w4 / linear_fp8 node."""
    if layout == "w8":
        x, qweight, scales, bias, group_size = node.args
        return x, [qweight, scales], bias, group_size
    if layout == "w4":
        x, qweight, scales, offsets, bias, group_size = node.args
        return x, [qweight, scales, offsets], bias, group_size
    x, qweight, scales, bias = node.args
    return x, [qweight, scales], bias, None


def _dequantized(layout: str, tensors: list[torch.Tensor], group_size: int,
                 compute_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if layout == "fp8":
        qweight, scales = tensors
        # fp8 values are exact in bfloat16, float16 and float32; the scales multiply the result.
        return {"weight": qweight.to(compute_dtype), "column_scales": scales.float()}
    weight = dequantize_w8(*tensors, group_size) if layout == "w8" else dequantize_w4(*tensors, group_size)
    return {"weight": weight.to(compute_dtype)}


def _bound(node: Node) -> bool:
    """Whether the node's weight tensors are bound to the module (get_attr), as the executor binds them."""
    return all(isinstance(arg, Node) and arg.op == "get_attr" for arg in node.args[1:3])


def _buffer(graph_module: GraphModule, node: Node) -> torch.Tensor:
    if not isinstance(node, Node) or node.op != "get_attr":
        raise TypeError(f"quantized linear weight {node} is not a bound weight (get_attr)")
    return getattr(graph_module, node.target)


def _attribute(graph_module: GraphModule, name: str, tensor: torch.Tensor) -> Node:
    if not hasattr(graph_module, name):
        graph_module.register_buffer(name, tensor, persistent=False)
    return graph_module.graph.get_attr(name)


def _drop_unused_buffers(graph_module: GraphModule) -> None:
    for node in list(graph_module.graph.find_nodes(op="get_attr")):
        if not node.users:
            graph_module.graph.erase_node(node)
            if not graph_module.graph.find_nodes(op="get_attr", target=node.target):
                delattr(graph_module, node.target)
