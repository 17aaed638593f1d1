"""octavo::linear_w16: a float32 linear whose weight is stored in 16 bits (bfloat16 or float16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

WEIGHT_DTYPES = (torch.bfloat16, torch.float16)


@torch.library.custom_op("octavo::linear_w16", mutates_args=())
def linear_w16(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``input @ weight.float().T + bias``, computed in float32 from 16-bit weights.

    Shapes: ``input`` float32 [..., K]; ``weight`` bfloat16 or float16 [N, K]; ``bias`` float32
    [N] or None. Returns float32 [..., N] with
    ``out[..., n] = sum_k input[..., k] * float32(weight[n, k]) + bias[n]``, every product and
    sum in float32 (the summation order is unspecified, as for aten.linear). Widening a bf16 or
    fp16 value to float32 is exact, so this is the float32 linear over the 16-bit-rounded weights;
    only the storage (and the bytes a matmul reads) is narrow.
    """
    check_linear_w16(input, weight, bias)
    return F.linear(input, weight.float(), bias)


@linear_w16.register_fake
def _(input, weight, bias=None):
    return input.new_empty((*input.shape[:-1], weight.shape[0]), dtype=torch.float32)


def check_linear_w16(input: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """Raise ValueError unless the arguments are those linear_w16 is defined for."""
    if input.dtype != torch.float32:
        raise ValueError(f"linear_w16: input must be float32, got {input.dtype}")
    if weight.dtype not in WEIGHT_DTYPES or weight.dim() != 2:
        raise ValueError(f"linear_w16: weight must be a 2-d bfloat16 or float16 tensor, got {weight.dtype} "
                         f"{list(weight.shape)}")
    if input.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_w16: input {list(input.shape)} does not end in {weight.shape[1]}")
    if bias is not None and (bias.dtype != torch.float32 or list(bias.shape) != [weight.shape[0]]):
        raise ValueError(f"linear_w16: bias must be float32 [{weight.shape[0]}], got {bias.dtype} {list(bias.shape)}")
