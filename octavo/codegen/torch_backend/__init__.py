"""The torch backend: the reference and CPU implementation of every octavo op."""

from __future__ import annotations

import torch

from octavo.codegen.torch_backend.attention import paged_attention

octavo = torch.ops.octavo

KERNELS = {
    octavo.paged_attention.default: paged_attention,
}
