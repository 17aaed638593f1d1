"""Greedy tokens against Hugging Face's logits under teacher forcing: equal, or a near tie by a stated margin.

Where two correct implementations round differently (bfloat16 arithmetic, bfloat16 activations in
quantized kernels), a greedy token may differ from HF's argmax where the top two logits are nearly
tied. `check_near_ties` feeds HF the prompt and Octavo's tokens at once and requires, at every
output position: the token is in HF's top 5, and HF's top logit exceeds the token's by at most
`margin * |top|`. It also counts the positions where HF's own runner-up lies within that margin:
if that share grew past `max_runner_up_share`, the margin would let through a model that differs
from HF by more than rounding.
"""

from __future__ import annotations

import torch


def check_near_ties(hf_model, prompts: list[list[int]], outputs: list[list[int]], margin: float,
                    max_runner_up_share: float) -> float:
    """Assert the agreement described in the module docstring; returns the share of positions whose HF
    runner-up is within the margin."""
    runner_up_within, positions = 0, 0
    for index, (prompt, ours) in enumerate(zip(prompts, outputs, strict=True)):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].float()
        chosen_ids = torch.tensor(ours).unsqueeze(1)
        top5 = logits.topk(5, dim=-1)
        outside = (~(top5.indices == chosen_ids).any(dim=1)).nonzero().flatten().tolist()
        assert not outside, f"prompt {index}: tokens outside HF's top 5 at output positions {outside}"
        top = top5.values[:, 0]
        allowed = margin * top.abs()
        below = top - logits.gather(1, chosen_ids).squeeze(1)
        worst = int((below - allowed).argmax())
        assert below[worst] <= allowed[worst], (
            f"prompt {index}, output position {worst}: token {ours[worst]} is {float(below[worst]):.3f} below "
            f"HF's top logit {float(top[worst]):.2f}, more than the near-tie margin {float(allowed[worst]):.3f}")
        runner_up_within += int((top - top5.values[:, 1] <= allowed).sum())
        positions += len(ours)
    share = runner_up_within / positions
    assert share <= max_runner_up_share, (
        f"HF's runner-up is within the margin at {runner_up_within}/{positions} positions: the margin is loose")
    return share
