"""octavo::rms_norm and octavo::fused_add_rms_norm: Hugging Face's RMSNorm, optionally after the residual add.

The reference implementations are the exact op sequence of transformers'
LlamaRMSNorm (shared by Mistral, Qwen2, Qwen3 and Phi-3), or with
``multiply_in_float32`` that of Gemma's and OLMo 2's RMSNorm (the weight
applied before the cast back; Gemma's ``1 + w`` is folded into the weight by
fuse_rms_norm), so a graph using these ops computes bit for bit what the
decomposed graph computed, in float32 and in bfloat16/float16 alike.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("octavo::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, multiply_in_float32: bool = False) -> Tensor:
    """Root-mean-square normalization over the last dim, as transformers' LlamaRMSNorm computes it.

    Shapes: ``x`` [..., H] (any leading dims, each row normalized on its own),
    ``weight`` [H]. With ``h = x.to(float32)``:
    ``h = h * rsqrt(mean(h ** 2, dim=-1, keepdim=True) + eps)``, and the
    result is ``weight * h.to(x.dtype)``: the same shape as ``x``, in the
    dtype that multiplying ``weight`` by an ``x.dtype`` tensor gives (``x.dtype``
    when both match). The mean and the rsqrt are computed in float32 even for
    bfloat16/float16 inputs; the last multiply is in the weight/x dtype.

    With ``multiply_in_float32`` the weight multiplies the float32 value and
    the product is rounded once: ``(h * weight.to(float32)).to(x.dtype)``,
    in ``x.dtype``.
    """
    return rms_norm_reference(x, weight, eps, multiply_in_float32)


@rms_norm.register_fake
def _(x, weight, eps, multiply_in_float32=False):
    # Shapes only: running the reference on fake tensors would cost ~25 ms per node at compile time.
    return torch.empty_like(x, dtype=_result_dtype(x, weight, multiply_in_float32))


@torch.library.custom_op("octavo::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                       multiply_in_float32: bool = False) -> tuple[Tensor, Tensor]:
    """The residual add of a decoder block followed by the next RMSNorm, in one op.

    Shapes: ``x`` and ``residual`` [..., H] of one dtype, ``weight`` [H].
    ``new_residual = residual + x`` (computed in that operand order, in
    ``x.dtype``); returns ``(rms_norm(new_residual, weight, eps), new_residual)``
    with ``rms_norm`` (and ``multiply_in_float32``) exactly as octavo::rms_norm
    defines it. Nothing is written in place: both results are new tensors.
    """
    return fused_add_rms_norm_reference(x, residual, weight, eps, multiply_in_float32)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps, multiply_in_float32=False):
    new_residual = torch.empty_like(x, dtype=torch.promote_types(residual.dtype, x.dtype))
    return (torch.empty_like(new_residual, dtype=_result_dtype(new_residual, weight, multiply_in_float32)),
            new_residual)


def _result_dtype(x: Tensor, weight: Tensor, multiply_in_float32: bool) -> torch.dtype:
    return x.dtype if multiply_in_float32 else torch.promote_types(weight.dtype, x.dtype)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, multiply_in_float32: bool = False) -> Tensor:
    """The definition (LlamaRMSNorm.forward op for op; with multiply_in_float32, Gemma's/OLMo 2's)."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    if multiply_in_float32:
        return (hidden * weight.to(torch.float32)).to(x.dtype)
    return weight * hidden.to(x.dtype)


def fused_add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                 multiply_in_float32: bool = False) -> tuple[Tensor, Tensor]:
    """The definition: the residual add, then rms_norm_reference of its result."""
    new_residual = residual + x
    return rms_norm_reference(new_residual, weight, eps, multiply_in_float32), new_residual
