"""w4-awq-gptq on the tiny llama: AWQ's folds, then GPTQ on the scaled weights, against RTN and w4-awq."""

from __future__ import annotations

import pytest
import torch

from octavo.config import CompileConfig
from octavo.passes import run_pipeline
from octavo.passes.awq_search import output_error
from octavo.passes.quant_schemes import scheme_for
from octavo.passes.quantize_rtn import fake_quantize_w4
from tests.passes.calibration_harness import calibrated_context, fused_llama
from tests.passes.fusion_harness import clone_graph

GROUP = 16


def test_each_linear_beats_rtn_and_awq_on_the_same_scaled_weight():
    """After the same folds, every linear's weight as applied to the unscaled input (stored values / s) is
    measured on the float calibration rows (their Gram matrix). GPTQ on the scaled Hessian must beat RTN of
    the same scaled weight by a margin, and AWQ's clipping + RTN (w4-awq's values for that weight)."""
    base = fused_llama()
    ctx = calibrated_context(base, quant="w4-awq-gptq", group_size=GROUP)
    scheme = scheme_for(ctx.config)
    scheme.prepare(base.graph_module, ctx)
    awq = scheme_for(CompileConfig(quant="w4-awq", group_size=GROUP))
    awq.input_scales = scheme.input_scales
    assert len(scheme.input_scales) == 6  # fused qkv, fused gate_up and down in each of 2 layers
    for name, scales in scheme.input_scales.items():
        scaled = ctx.weights[name]
        original = scaled / scales
        parts = ctx.merged_weights.get(name, [name])
        stats = ctx.calibration.linear_inputs[parts[0]]
        gram = stats.gram / stats.rows
        solved = scheme.quantize_linear(name, scaled, ctx)
        assert solved.origin == "awq-gptq"
        error = output_error(original, solved.dequantize() / scales, gram)
        rtn = output_error(original, fake_quantize_w4(scaled, GROUP) / scales, gram)
        clipped = output_error(original, awq.quantize_linear(name, scaled, ctx).dequantize() / scales, gram)
        assert error < 0.9 * rtn and error < clipped, (name, error, rtn, clipped)


@pytest.mark.parametrize("act_order", [False, True])
def test_the_scheme_folds_solves_and_records(act_order):
    base = fused_llama()
    ctx = calibrated_context(base, quant="w4-awq-gptq", group_size=GROUP, gptq_act_order=act_order)
    graph_module = run_pipeline(clone_graph(base.graph_module), ctx, ["quantize_weights"])
    record = ctx.quantization
    assert record["scheme"] == "w4-awq-gptq" and record["values"] == {"awq-gptq": 8, "rtn": 2}
    assert record["awq"]["folded"] == 6 and record["gptq"]["act_order"] is act_order
    assert len(graph_module.graph.find_nodes(op="call_function", target=torch.ops.octavo.linear_w4.default)) == 8
