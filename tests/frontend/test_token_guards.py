"""The exported program must hold for every token count: torch.export's guards are checked, not trusted.

Small modules of the flat-token form (input_ids [T], positions [T]) are exported the way the frontend
exports a model; a guard that some token count breaks, or a range torch narrowed, is a clear
OctavoError, while guards that hold for every T (even ones a torch release cannot prove) pass.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from octavo.errors import OctavoError
from octavo.frontend.token_guards import MIN_NUM_TOKENS, check_token_dimension, guard_holds, token_counts

TOKENS = "L['input_ids'].size()[0]"


def export(forward) -> torch.export.ExportedProgram:
    class Module(torch.nn.Module):
        def forward(self, input_ids, positions):
            return forward(input_ids, positions)

    example = (torch.arange(11), torch.arange(11))
    dims = {name: {0: Dim.DYNAMIC(min=MIN_NUM_TOKENS)} for name in ("input_ids", "positions")}
    return torch.export.export(Module(), example, dynamic_shapes=dims, strict=False)


def repeat_heads(input_ids, positions):
    """HF's repeat_kv on a [1, 2, T, 16] tensor: torch 2.11 records min(16*T, 32*T) == 16*T for it."""
    keys = (input_ids.float()[:, None] * torch.ones(32)).view(1, -1, 2, 16).transpose(1, 2) * 2
    repeated = keys[:, :, None].expand(1, 2, 3, keys.shape[2], 16).reshape(1, 6, keys.shape[2], 16)
    return repeated.sum(-1) + positions


def test_guards_that_hold_for_every_token_count_pass():
    check_token_dimension(export(repeat_heads), "llama")
    assert guard_holds(f"min(16*{TOKENS}, 32*{TOKENS}) == (16*{TOKENS})", 3)
    assert guard_holds(f"{TOKENS} == L['positions'].size()[0]", 5)


def test_a_guard_some_token_count_breaks_is_refused_naming_it():
    def parity_branch(input_ids, positions):
        return input_ids * 2 if input_ids.shape[0] % 2 == 1 else input_ids * 3

    with pytest.raises(OctavoError, match=r"valid only where .*% 2.* \(not for 2 tokens\)"):
        check_token_dimension(export(parity_branch), "llama")


def test_a_narrowed_range_is_refused():
    def bounded(input_ids, positions):
        torch._check(input_ids.shape[0] <= 4096)
        return input_ids + positions

    with pytest.raises(OctavoError, match=r"limited model_type 'llama' to token counts in \[2, 4096\]"):
        check_token_dimension(export(bounded), "llama")


def test_the_sweep_covers_small_counts_and_both_sides_of_powers_of_two():
    counts = token_counts()
    assert counts[:3] == [2, 3, 4] and set(range(2, 1025)) <= set(counts)
    assert {4095, 4096, 4097, 1 << 24} <= set(counts)
