"""w4-gptq on the tiny llama: every linear rounded by GPTQ, closer to its float outputs than RTN on the calibration."""

from __future__ import annotations

import pytest
import torch

from octavo.config import CompileConfig
from octavo.errors import OctavoError
from octavo.ir.quantized_layout import W4, QuantizedWeight
from octavo.passes import run_pipeline
from octavo.passes.awq_search import output_error
from octavo.passes.quantize_rtn import quantize_w4
from tests.passes.calibration_harness import calibrated_context, fused_llama
from tests.passes.fusion_harness import clone_graph

GROUP = 16


def test_every_linear_is_closer_to_its_float_output_than_rtn():
    """The error measured on the calibration rows GPTQ saw (their Gram matrix): the greedy solver
    lowers it well below RTN's on each of the 8 linears (a margin, not a hair)."""
    base = fused_llama()
    ctx = calibrated_context(base, quant="w4-gptq", group_size=GROUP)
    graph_module = run_pipeline(clone_graph(base.graph_module), ctx, ["quantize_weights"])
    record = ctx.quantization
    assert record["values"] == {"gptq": 8, "rtn": 2} and record["gptq"]["solved"] == 8
    assert record["calibration"] == {"source": "test", "sha256": "0" * 64, "tokens": 96, "runs": 2,
                                     "tokens_used": 96}
    linears = graph_module.graph.find_nodes(op="call_function", target=torch.ops.octavo.linear_w4.default)
    assert len(linears) == 8
    for linear in linears:
        name = linear.args[1].name.removesuffix("_qweight")
        parts = base.ctx.merged_weights.get(f"{name}_weight", [f"{name}_weight"])
        stats = ctx.calibration.linear_inputs[parts[0]]
        weight = base.ctx.weights[f"{name}_weight"]
        stored = QuantizedWeight(W4, ctx.weights[f"{name}_qweight"], ctx.weights[f"{name}_scales"],
                                 ctx.weights[f"{name}_offsets"], GROUP)
        gram = stats.gram / stats.rows
        gptq = output_error(weight, stored.dequantize(), gram)
        rtn = output_error(weight, quantize_w4(weight, GROUP).dequantize(), gram)
        assert gptq < 0.9 * rtn, (name, gptq, rtn)


def test_act_order_is_recorded():
    base = fused_llama()
    ctx = calibrated_context(base, quant="w4-gptq", group_size=GROUP, gptq_act_order=True)
    run_pipeline(clone_graph(base.graph_module), ctx, ["quantize_weights"])
    assert ctx.quantization["gptq"]["act_order"] is True and ctx.quantization["values"]["gptq"] == 8


def test_act_order_is_refused_for_other_schemes():
    with pytest.raises(OctavoError, match="--gptq-act-order applies to --quant w4-gptq, not w4-awq"):
        CompileConfig(quant="w4-awq", gptq_act_order=True)
