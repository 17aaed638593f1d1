"""Arguments of octavo.moe calls for the kernel tests: random experts, float or quantized, with unused experts poisoned.

`make_moe_batch` draws x, a router and E stacked experts. Its router makes some experts unreachable
(their router rows are far negative), and their weights (and, quantized, their scales) are NaN: a
kernel that reads or multiplies an expert no token chose returns NaN where the definition does not.
"""

from __future__ import annotations

import torch

from octavo.passes.quant_schemes import rtn

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 48, 8, 2
UNREACHABLE = (5, 6)  # experts no token may choose
# fp32: float32 sums in other orders (~1e-6 relative of sums of ~1); bf16: each side rounds its expert outputs and
# products to bf16 (2^-8 relative) and the sums may straddle a rounding boundary: a few bf16 ulps of |out| ~ 1.
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}
# Quantized: the CPU w8 GEMV scales each group's sum instead of each weight (float32 reassociation, ~1e-6).
QUANTIZED_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def make_moe_batch(tokens: int, dtype: torch.dtype = torch.float32, layout: str | None = None,
                   group_size: int | None = 32, seed: int = 0, normalize: bool = True,
                   round_weights: bool = True, activation: str = "silu") -> dict:
    """Keyword arguments of one octavo.moe call (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    x[:, 0] = 3.0  # a constant feature: the unreachable experts' router rows read only it, with a large -weight
    router = torch.randn(EXPERTS, HIDDEN, generator=generator) * 0.5
    router[:, 0] = 0.0
    router[list(UNREACHABLE)] = 0.0
    router[list(UNREACHABLE), 0] = -50.0
    gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * HIDDEN ** -0.5
    down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * INTERMEDIATE ** -0.5
    batch = {"x": x.to(dtype), "router_weight": router.to(dtype), "top_k": TOP_K, "normalize": normalize,
             "activation": activation, "round_weights": round_weights}
    if layout is None:
        for weight in (gate_up, down):
            weight[list(UNREACHABLE)] = float("nan")
        batch.update(gate_up=gate_up.to(dtype), down=down.to(dtype))
        return batch
    for name, weight in (("gate_up", gate_up), ("down", down)):
        parts = [rtn(layout, expert, group_size) for expert in weight]
        batch[name] = torch.stack([part.qweight for part in parts])
        scales = torch.stack([part.scales for part in parts])
        scales[list(UNREACHABLE)] = float("nan")
        batch[f"{name}_scales"] = scales
        if layout == "w4":
            batch[f"{name}_offsets"] = torch.stack([part.offsets for part in parts])
    batch["group_size"] = group_size or 0
    return batch


def reachable_experts_only(batch: dict) -> bool:
    """Whether the batch's routing indeed avoids the poisoned experts (so the definition's result is finite)."""
    from octavo.ir.ops.moe import route

    _, experts = route(batch["x"], batch["router_weight"], batch["top_k"], batch["normalize"], torch.float32)
    return not any(expert in UNREACHABLE for expert in experts.flatten().tolist())
