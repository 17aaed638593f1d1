"""octavo::silu_and_mul: the gated SiLU of a LLaMA-style MLP on the merged gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.library.custom_op("octavo::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(gate) * up`` where ``x = cat(gate, up, dim=-1)``.

    Shapes: ``x`` [..., 2 * I]; returns [..., I] in ``x.dtype``:
    ``silu(x[..., :I]) * x[..., I:]``, each op in ``x.dtype`` (as
    transformers' LlamaMLP computes ``act_fn(gate_proj(x)) * up_proj(x)``).
    The last dim must be even.
    """
    return silu_and_mul_reference(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def silu_and_mul_reference(x: Tensor) -> Tensor:
    """The definition. The gate half is made contiguous first so that silu walks it exactly as it walks
    the gate projection's own (contiguous) output: torch's CPU silu computes a row's tail elements with a
    scalar formula that can differ from the vectorized one in the last bit."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half].contiguous()) * x[..., half:]


@torch.library.custom_op("octavo::gelu_and_mul", mutates_args=())
def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(gate, approximate) * up`` where ``x = cat(gate, up, dim=-1)`` (Gemma's gated GELU MLP).

    Shapes: ``x`` [..., 2 * I]; returns [..., I] in ``x.dtype``:
    ``gelu(x[..., :I], approximate=approximate) * x[..., I:]``, each op in
    ``x.dtype`` as torch computes them (``approximate`` is "none", the erf
    form, or "tanh", transformers' gelu_pytorch_tanh). The last dim must be even.
    """
    return gelu_and_mul_reference(x, approximate)


@gelu_and_mul.register_fake
def _(x, approximate="none"):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def gelu_and_mul_reference(x: Tensor, approximate: str = "none") -> Tensor:
    """The definition, the gate half made contiguous first as in silu_and_mul_reference."""
    half = x.shape[-1] // 2
    return F.gelu(x[..., :half].contiguous(), approximate=approximate) * x[..., half:]
