"""The torch backend's LoRA kernel: every slot's factors at once where that costs little, else per segment."""

from __future__ import annotations

import torch
from torch import Tensor

from octavo.ir.ops.lora import lora_reference


def lora(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, token_slots: Tensor) -> Tensor:
    """Same semantics as octavo.ir.ops.lora.lora (see its docstring).

    When the slots' factors together are small beside the linear (S * R * (K + N) at most half of K * N,
    the linear's own multiply-adds per token), every token is shrunk by all S adapters in one GEMM over
    the S * R rows of ``lora_a``, the columns of the slots that are not its own are zeroed, and one GEMM
    over the slots' ``lora_b`` side by side expands what is left. That is the definition's arithmetic
    with zeros added to its float32 sums, and no host synchronization: the segmented definition finds
    the adapters present with ``unique``/``nonzero`` and their host copies, once per LoRA op of every
    step. Larger slot sets take the segmented definition, which computes only the adapters present.
    """
    slots, rank, in_features = lora_a.shape
    out_features = lora_b.shape[1]
    if slots * rank * (in_features + out_features) * 2 > in_features * out_features:
        return lora_reference(y, x, lora_a, lora_b, token_slots)
    rows = x.reshape(-1, in_features).float()
    shrunk = rows @ lora_a.reshape(slots * rank, in_features).float().t()  # [T, S*R]
    owner = torch.arange(slots, device=x.device).repeat_interleave(rank)  # the slot of each column
    own = owner.unsqueeze(0) == token_slots.view(-1, 1)  # slot -1 owns no column
    shrunk = torch.where(own, shrunk, torch.zeros((), dtype=shrunk.dtype, device=shrunk.device))
    expand = lora_b.float().permute(1, 0, 2).reshape(out_features, slots * rank)  # [N, S*R]
    out = torch.addmm(y.reshape(-1, out_features).float(), shrunk, expand.t())
    return out.to(y.dtype).view(y.shape)
