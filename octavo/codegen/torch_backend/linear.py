"""Torch kernel for octavo.linear_w16: widen the 16-bit weight, then torch's float32 linear."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def linear_w16(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Same semantics as octavo.ir.ops.linear.linear_w16 (a widened copy of the weight per call)."""
    return F.linear(input, weight.float(), bias)
