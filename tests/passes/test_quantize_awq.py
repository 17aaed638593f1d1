"""w4-awq: folding keeps the float function, the searches against their definitions, the scheme on a tiny model."""

from __future__ import annotations

import torch

from octavo.ir.linear_input_stats import LinearInputStats
from octavo.passes import run_pipeline
from octavo.passes.awq_search import (
    DEFAULT_RANGE_CUTS,
    clamp_groups,
    gram_blocks,
    output_error,
    refine_group_params,
    search_range,
    search_scales,
)
from octavo.passes.quant_schemes import scheme_for
from octavo.passes.quantize_rtn import fake_quantize_w4, quantize_w4, quantize_w4_on_params
from tests.passes.calibration_harness import calibrated_context, fused_llama
from tests.passes.fusion_harness import clone_graph, run_steps, traced_model

GROUP = 16


def test_folding_keeps_the_float_function():
    """Before quantization the folded graph computes the same logits and KV cache.

    Each folded weight is one float32 product or quotient of the original (relative error
    <= 2^-24 per element), so every linear's and norm's output moves by a few float32 ulps of
    its magnitude; through two layers and the attention that stays far below 1e-5 of the
    largest output, while the folds change weights by factors of up to the scales' spread (>>1e-5).
    """
    base = fused_llama()
    ctx = calibrated_context(base, quant="w4-awq", group_size=GROUP)
    scheme = scheme_for(ctx.config)
    scheme.prepare(base.graph_module, ctx)
    assert scheme.record["folded"] == 3 * 2  # qkv and gate_up after their norms, down after up; 2 layers
    norm = "model_layers_0_input_layernorm_weight"
    assert not torch.allclose(ctx.weights[norm], base.ctx.weights[norm], rtol=1e-3)
    expected = run_steps(base)
    folded = run_steps(base, weights=ctx.weights)
    for before, after in zip(expected, folded, strict=True):
        bound = 1e-5 * float(before.abs().max())
        torch.testing.assert_close(after, before, rtol=0, atol=bound)


def test_the_scale_loss_is_the_output_error_over_every_row():
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(200, 64, generator=generator) * torch.linspace(0.1, 4, 64)
    weight = torch.randn(24, 64, generator=generator)
    stats = LinearInputStats(64)
    stats.add(inputs)
    approximation = quantize_w4(weight, GROUP).dequantize()
    direct = (inputs @ approximation.T - inputs @ weight.T).pow(2).sum() / 200
    torch.testing.assert_close(torch.tensor(output_error(weight, approximation, stats.gram / 200)), direct,
                               rtol=1e-4, atol=0)


def test_scales_protect_the_channels_of_large_activations():
    """A few input channels 30x larger than the rest (as in LLMs): AWQ's scales lower the output error below RTN's."""
    generator = torch.Generator().manual_seed(2)
    magnitudes = torch.ones(128)
    magnitudes[[5, 40, 77, 100]] = 30.0
    inputs = torch.randn(512, 128, generator=generator) * magnitudes
    weight = torch.randn(64, 128, generator=generator) * 0.05
    stats = LinearInputStats(128)
    stats.add(inputs)
    gram = stats.gram / stats.rows
    scales, alpha, losses = search_scales([weight], gram, stats.abs_mean, GROUP)
    awq = fake_quantize_w4(weight * scales, GROUP) / scales
    reference = inputs @ weight.T
    awq_error = (inputs @ awq.T - reference).pow(2).mean()
    rtn_error = (inputs @ fake_quantize_w4(weight, GROUP).T - reference).pow(2).mean()
    assert alpha > 0 and awq_error < 0.7 * rtn_error, (alpha, float(awq_error), float(rtn_error))
    assert min(losses) == losses[int(alpha * 20)]


def test_the_range_search_picks_per_group_the_range_of_least_output_error():
    """Against rounding every candidate range of each group directly and measuring its output error on the rows.

    40 columns in groups of 16: the last group has 8. The errors are measured here on the inputs themselves
    (float32 sums over 300 rows, relative rounding ~1e-6) and in the search through the Gram blocks, so the
    chosen range must be the least of the candidates within 1e-4 relative, and never worse than the group's
    own min/max range (no clipping, RTN).
    """
    generator = torch.Generator().manual_seed(4)
    inputs = torch.randn(300, 40, generator=generator) * torch.linspace(0.2, 3, 40)
    weight = torch.randn(8, 40, generator=generator) + torch.linspace(-0.5, 0.5, 8).unsqueeze(1)
    stats = LinearInputStats(40)
    stats.add(inputs)
    low, high = search_range(weight, gram_blocks(stats.gram, GROUP), GROUP)
    chosen = clamp_groups(weight, low, high, GROUP)
    cut_any = False
    for row in range(8):
        for group, start in enumerate(range(0, 40, GROUP)):
            columns = slice(start, min(start + GROUP, 40))
            values = weight[row:row + 1, columns]
            lowest, highest = float(values.min()), float(values.max())
            errors = [_rounded_error(inputs[:, columns], values, lowest + bottom * (highest - lowest),
                                     highest - top * (highest - lowest)) for bottom, top in DEFAULT_RANGE_CUTS]
            picked = _rounded_error(inputs[:, columns], values, float(low[row, group]), float(high[row, group]))
            assert picked <= min(errors) * (1 + 1e-4) and picked <= errors[0], (row, group, picked, min(errors))
            assert torch.equal(chosen[row:row + 1, columns].amin(1), low[row, group:group + 1])
            assert torch.equal(chosen[row:row + 1, columns].amax(1), high[row, group:group + 1])
            cut_any |= (float(low[row, group]), float(high[row, group])) != (lowest, highest)
    assert cut_any


def _rounded_error(inputs: torch.Tensor, values: torch.Tensor, low: float, high: float) -> float:
    """The squared output error over the rows of `inputs` of `values` [1, n] rounded to w4 on the range [low, high]."""
    rounded = fake_quantize_w4(values.clamp(low, high), GROUP)
    return float((inputs @ (rounded - values).T).pow(2).sum())


def test_the_level_refit_never_raises_a_groups_output_error_and_lowers_some():
    """Refitted levels against the range search's, each group's output error measured on the input rows.

    The refit keeps a group's new (scale, offset) only where its error through the Gram block is lower; the
    same error measured here on the 300 rows themselves (float32 sums, relative rounding ~1e-6) must then
    not exceed the range search's by more than 1e-4 relative, and the refit must lower the total by more
    than 1% (least squares over two free parameters against a 36-point grid of ranges). The stored tensors
    are float16 and dequantize to ``q * scale + offset`` with q the nearest level of each value.
    """
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(300, 40, generator=generator) * torch.linspace(0.2, 3, 40)
    weight = torch.randn(8, 40, generator=generator) + torch.linspace(-0.5, 0.5, 8).unsqueeze(1)
    stats = LinearInputStats(40)
    stats.add(inputs)
    blocks = gram_blocks(stats.gram, GROUP)
    low, high = search_range(weight, blocks, GROUP)
    scales, offsets = refine_group_params(weight, blocks, GROUP, low, high)
    assert scales.dtype == offsets.dtype == torch.float16 and scales.shape == (8, 3)
    refitted = quantize_w4_on_params(weight, GROUP, scales, offsets)
    searched = quantize_w4(clamp_groups(weight, low, high, GROUP), GROUP)
    total_refitted = total_searched = 0.0
    for group, start in enumerate(range(0, 40, GROUP)):
        columns = slice(start, min(start + GROUP, 40))
        for row in range(8):
            values = weight[row, columns]
            levels = ((values - offsets[row, group].float()) / scales[row, group].float()).round().clamp(0, 15)
            expected = levels * scales[row, group].float() + offsets[row, group].float()
            assert torch.equal(refitted.dequantize()[row, columns], expected)
        new = (inputs[:, columns] @ (refitted.dequantize() - weight)[:, columns].T).pow(2).sum(0)
        old = (inputs[:, columns] @ (searched.dequantize() - weight)[:, columns].T).pow(2).sum(0)
        assert bool((new <= old * (1 + 1e-4)).all()), (group, new, old)
        total_refitted, total_searched = total_refitted + float(new.sum()), total_searched + float(old.sum())
    assert total_refitted < 0.99 * total_searched


def test_the_scheme_quantizes_every_linear_and_records_the_folds():
    base = fused_llama()
    ctx = calibrated_context(base, quant="w4-awq", group_size=GROUP)
    graph_module = run_pipeline(clone_graph(base.graph_module), ctx, ["quantize_weights"])
    record = ctx.quantization
    assert record["scheme"] == "w4-awq" and record["values"] == {"awq": 8, "rtn": 2}
    assert record["awq"]["folded"] == 6 and record["calibration"]["source"] == "test"
    assert len(graph_module.graph.find_nodes(op="call_function", target=torch.ops.octavo.linear_w4.default)) == 8


def test_sites_whose_weights_keep_supplied_values_are_left_unscaled():
    """A GGUF Q4 value at the scheme's group size is stored as it is, so scaling its input would change the model."""
    base = fused_llama()
    ctx = calibrated_context(base, quant="w4-awq", group_size=GROUP)
    prefix = "model_layers_0_self_attn_"
    for part in ("q_proj", "k_proj", "v_proj"):
        name = f"{prefix}{part}_weight"
        ctx.provided_weights[name] = quantize_w4(traced_model("llama", "float32")[1].weights[name], GROUP)
    scheme = scheme_for(ctx.config)
    scheme.prepare(base.graph_module, ctx)
    assert scheme.record["left_unscaled"] == 1 and scheme.record["folded"] == 5
    norm = "model_layers_0_input_layernorm_weight"
    assert torch.equal(ctx.weights[norm], base.ctx.weights[norm])

