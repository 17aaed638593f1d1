"""Shared by the calibrated scheme tests: the tiny llama's fused graph with calibration statistics in its context."""

from __future__ import annotations

import functools

import torch

from octavo.config import CompileConfig
from octavo.frontend.architectures import architecture_for
from octavo.frontend.calibration import collect_linear_inputs
from octavo.passes import PassContext
from octavo.passes.quant_schemes import Calibration, QuantScheme
from tests.passes.fusion_harness import ALL_PASSES, Compiled, compiled, traced_model


@functools.cache
def calibration() -> Calibration:
    """Statistics of the tiny llama's linear inputs over two runs of 48 random tokens."""
    _, traced = traced_model("llama", "float32")
    runs = _runs()
    stats = collect_linear_inputs(traced.graph_module, traced.weights, runs)
    return Calibration("test", "0" * 64, [token for run in runs for token in run], stats, len(runs), 96)


def sequential_calibration(scheme: QuantScheme) -> Calibration:
    """The same runs in sequential mode, each weight replaced as `scheme` says (what the compiler does)."""
    _, traced = traced_model("llama", "float32")
    runs = _runs()
    result = Calibration("test", "0" * 64, [token for run in runs for token in run], {}, len(runs), 96)
    result.linear_inputs = collect_linear_inputs(
        traced.graph_module, traced.weights, runs,
        replace_weight=lambda name, weight, stats: scheme.replace_calibrated_weight(name, weight, stats, result))
    return result


def _runs() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 49152, (48,), generator=generator).tolist() for _ in range(2)]


def fused_llama() -> Compiled:
    """The tiny llama after the default passes before quantize_weights (cached: do not modify)."""
    return compiled("llama", "float32", tuple(ALL_PASSES))


def calibrated_context(base: Compiled, calibrated: Calibration | None = None, **options) -> PassContext:
    """A context over a copy of `base`'s weights, with `options` and the calibration statistics (`calibrated`,
    else the float model's)."""
    model, traced = traced_model("llama", "float32")
    return PassContext(config=CompileConfig(**options), weights=dict(base.ctx.weights), model_config=model.config,
                       architecture=architecture_for(model.config), fake_mode=traced.fake_mode,
                       symbols={"T": traced.num_tokens}, merged_weights=dict(base.ctx.merged_weights),
                       calibration=calibrated or calibration(), kv_layout=base.ctx.kv_layout)
