"""w4-awq: folding keeps the float function, the searches against their definitions, the scheme on a tiny model."""

from __future__ import annotations

import torch

from octavo.ir.linear_input_stats import LinearInputStats
from octavo.passes import run_pipeline
from octavo.passes.awq_search import clip_groups, gram_blocks, output_error, search_clip, search_scales
from octavo.passes.quant_schemes import scheme_for
from octavo.passes.quantize_rtn import fake_quantize_w4, quantize_w4
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


def test_clipping_picks_per_group_the_bound_of_least_output_error():
    """Checked against trying every bound of the search on one group directly."""
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(300, 32, generator=generator)
    weight = torch.randn(8, 32, generator=generator)
    stats = LinearInputStats(32)
    stats.add(inputs)
    bound = search_clip(weight, gram_blocks(stats.gram, GROUP), GROUP)
    for row in range(8):
        for group in range(2):
            columns = slice(group * GROUP, (group + 1) * GROUP)
            top = float(weight[row, columns].abs().max())
            errors = []
            for step in range(10):
                candidate = weight[row:row + 1, columns].clamp(-top * (1 - step / 20), top * (1 - step / 20))
                difference = fake_quantize_w4(candidate, GROUP) - weight[row:row + 1, columns]
                errors.append(float((inputs[:, columns] @ difference.T).pow(2).sum()))
            best = min(range(10), key=errors.__getitem__)
            assert abs(float(bound[row, group]) - top * (1 - best / 20)) < 1e-6 * top
    tops = weight.abs().view(8, 2, GROUP).amax(-1)
    assert (bound < tops).any() and (bound == tops).any()  # some groups are clipped, some are not
    clipped = clip_groups(weight, bound, GROUP)
    assert torch.equal(clipped.abs().view(8, 2, GROUP).amax(-1), bound)


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

