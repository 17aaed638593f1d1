"""Tracing longrope on transformers releases that pick its frequencies in a Python branch.

Longrope (Phi-3 128k, Phi-4-mini) uses its long factors when the batch's largest position
reaches ``original_max_position_embeddings``. Later transformers releases pick the factors
with ``torch.where`` on that comparison and copy the result into ``inv_freq``, which
torch.export traces and fuse_rope tabulates per position. Earlier ones (5.17) branch in
Python on the comparison, a data-dependent condition torch.export refuses. For those,
`traceable_longrope` runs each longrope rotary module, while the model is exported, with the
later releases' update: the same frequencies (transformers' own longrope init for the long
set, the module's original buffer for the short one), the same choice, the same buffer copy;
then the module's own forward. Nothing changes on releases that trace already.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch

_PYTHON_BRANCH = "if seq_len > original_max_position_embeddings"


def longrope_is_a_python_branch() -> bool:
    """Whether the installed transformers picks longrope's factors in a Python branch (not traceable)."""
    from transformers import modeling_rope_utils

    return _PYTHON_BRANCH in inspect.getsource(modeling_rope_utils.dynamic_rope_update)


@contextlib.contextmanager
def traceable_longrope(model: torch.nn.Module) -> Iterator[None]:
    """While active, longrope rotary modules of `model` pick their factors with torch.where (module docstring)."""
    modules = [module for module in model.modules() if getattr(module, "rope_type", None) == "longrope"]
    if not modules or not longrope_is_a_python_branch():
        yield
        return
    for module in modules:
        module.forward = _where_update_forward(module)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def _where_update_forward(module: torch.nn.Module):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # The module's own forward, under transformers' dynamic_rope_update (and no_grad): traced under no_grad anyway.
    rope_forward = inspect.unwrap(type(module).forward)
    original_max = module.config.rope_parameters["original_max_position_embeddings"]
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, module.original_inv_freq.device,
                                                       seq_len=original_max + 1)
    module.long_inv_freq = long_inv_freq

    def forward(x: torch.Tensor, position_ids: torch.Tensor):
        seq_len = torch.max(position_ids) + 1
        module.inv_freq.copy_(torch.where(seq_len > original_max, module.long_inv_freq, module.original_inv_freq))
        return rope_forward(module, x, position_ids)

    return forward
