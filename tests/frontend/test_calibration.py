"""The calibration runner: statistics of every linear's input, against HF's own modules seen through hooks."""

from __future__ import annotations

import copy
import re

import torch

from octavo.frontend.calibration import collect_linear_inputs
from tests.passes.fusion_harness import traced_model


def _hf_linear_inputs(model, runs: list[list[int]]) -> dict[str, list[torch.Tensor]]:
    """The input rows of every nn.Linear of the HF model over `runs`, by its weight's placeholder name."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            key = re.sub(r"\W", "_", f"{name}.weight")
            hooks.append(module.register_forward_hook(
                lambda _module, args, _output, key=key: seen.setdefault(key, []).append(
                    args[0].reshape(-1, args[0].shape[-1]))))
    try:
        with torch.no_grad():
            for run in runs:
                model(input_ids=torch.tensor([run]), position_ids=torch.arange(len(run)).unsqueeze(0), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_statistics_equal_the_inputs_hf_linears_see():
    """Sums of float32 products in another order: equal up to float32 accumulation (1e-4 relative)."""
    model, traced = traced_model("llama", "float32")
    generator = torch.Generator().manual_seed(0)
    runs = [torch.randint(0, 49152, (length,), generator=generator).tolist() for length in (19, 7)]
    stats = collect_linear_inputs(traced.graph_module, traced.weights, runs)
    expected = _hf_linear_inputs(model, runs)
    assert set(stats) == set(expected)  # every linear, the lm_head included
    for name, rows in expected.items():
        rows = torch.cat(rows)
        assert stats[name].rows == 26
        torch.testing.assert_close(stats[name].gram, rows.T @ rows, rtol=1e-4, atol=1e-4 * float(rows.abs().max()))
        torch.testing.assert_close(stats[name].abs_mean, rows.abs().mean(0), rtol=1e-5, atol=1e-6)
    prefix = "model_layers_1_self_attn_"
    assert stats[f"{prefix}q_proj_weight"] is stats[f"{prefix}k_proj_weight"] is stats[f"{prefix}v_proj_weight"]
    assert stats[f"{prefix}o_proj_weight"] is not stats[f"{prefix}q_proj_weight"]


def test_sequential_mode_records_the_inputs_of_the_model_with_every_earlier_weight_replaced():
    """With every linear weight but the lm_head halved (what the replacer returns), each linear's input in
    the sequential run is what it reads in the HF model whose linears are all halved: a linear's input
    depends only on the linears before it. The replacer is called once per weight, in graph order, when
    its input's statistics hold every run's rows; the lm_head is never replaced."""
    model, traced = traced_model("llama", "float32")
    generator = torch.Generator().manual_seed(1)
    runs = [torch.randint(0, 49152, (length,), generator=generator).tolist() for length in (13, 9)]
    calls = []

    def halve(name, weight, stats):
        calls.append((name, stats.rows))
        return weight * 0.5

    linear_weights = [node.args[1].name for node in traced.graph_module.graph.find_nodes(
        op="call_function", target=torch.ops.aten.linear.default)]
    before = {name: traced.weights[name].clone() for name in linear_weights}
    stats = collect_linear_inputs(traced.graph_module, traced.weights, runs, replace_weight=halve)
    assert calls == [(name, 22) for name in linear_weights[:-1]]
    halved = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in halved.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.mul_(0.5)
    expected = _hf_linear_inputs(halved, runs)
    assert set(stats) == set(expected)
    for name, rows in expected.items():
        rows = torch.cat(rows)
        torch.testing.assert_close(stats[name].gram, rows.T @ rows, rtol=1e-4, atol=1e-4 * float(rows.abs().max()))
    assert all(torch.equal(traced.weights[name], before[name]) for name in linear_weights)  # only the run's copy
