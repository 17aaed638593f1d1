"""The torch backend: the reference and CPU implementation of every octavo op.

KERNELS maps each octavo op to its kernel registered as an ``octavo_torch::``
custom op (see octavo.codegen.kernel_ops); PYTHON_KERNELS holds the plain
functions, which the compiled executor may inline for Inductor to fuse.
"""

from __future__ import annotations

import torch

from octavo.codegen.kernel_ops import kernel_op_table
from octavo.codegen.torch_backend import quantized_linear  # noqa: F401  (registers the octavo_torch ops)
from octavo.codegen.torch_backend.activation import gelu_and_mul, silu_and_mul
from octavo.codegen.torch_backend.attention import paged_attention
from octavo.codegen.torch_backend.fused_pointwise import fused_pointwise
from octavo.codegen.torch_backend.linear import linear_w16
from octavo.codegen.torch_backend.lora import lora
from octavo.codegen.torch_backend.moe import moe
from octavo.codegen.torch_backend.norm import fused_add_rms_norm, rms_norm
from octavo.codegen.torch_backend.rotary import rotary_embedding
from octavo.ir.quantized_layout import gather_rows_w4, gather_rows_w8

octavo = torch.ops.octavo

PYTHON_KERNELS = {
    octavo.paged_attention.default: paged_attention,
    octavo.rms_norm.default: rms_norm,
    octavo.fused_add_rms_norm.default: fused_add_rms_norm,
    octavo.rotary_embedding.default: rotary_embedding,
    octavo.silu_and_mul.default: silu_and_mul,
    octavo.gelu_and_mul.default: gelu_and_mul,
    octavo.fused_pointwise.default: fused_pointwise,
    octavo.moe.default: moe,
    # The reference ops' own code is the kernel: a gather and a dequantization of the gathered rows (ATen
    # code, which the compiled executor inlines: a Python op called back from compiled code costs a host hop).
    octavo.embedding_w8.default: gather_rows_w8,
    octavo.embedding_w4.default: gather_rows_w4,
    # Quantized linears whose weights are bound get packed kernels at load (weight_packing); a graph run with
    # weights as inputs runs the reference (dequantize, then a float32 matmul).
    octavo.linear_w8.default: octavo.linear_w8.default,
    octavo.linear_w4.default: octavo.linear_w4.default,
    octavo.linear_fp8.default: octavo.linear_fp8.default,
    octavo.linear_w16.default: linear_w16,
    # LoRA: every slot at once while the slots are small beside the linear, else per adapter segment.
    octavo.lora.default: lora,
}

KERNELS = kernel_op_table("octavo_torch", PYTHON_KERNELS)
