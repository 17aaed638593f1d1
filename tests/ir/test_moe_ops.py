"""octavo.moe (the reference op) against transformers' own sparse MoE blocks, and its quantized forms.

Each family's block is built from its tiny config with random weights and run with transformers'
eager experts (the loop over the experts a batch hit); the op gets the block's router weight and
stacked expert weights as they are. The routing must pick exactly the experts the block's router
picks, and the outputs must agree up to float32 summation order (the block adds experts in expert
order, the op slots in slot order).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import octavo.ir
from octavo.ir.ops.moe import moe_reference, route
from octavo.passes.quant_schemes import rtn
from tests.tiny_models import tiny_config

octavo = torch.ops.octavo
TOKENS = 37
# (model_type, normalize, round_weights): the routing of each family as its router computes it.
FAMILIES = [("qwen3_moe", True, True), ("qwen2_moe", False, True), ("mixtral", True, False), ("olmoe", False, True)]


def hf_block(model_type: str, dtype: torch.dtype = torch.float32):
    """The sparse MoE block of layer 0 of a random tiny model (eager experts)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32)
    block = model.model.layers[0].mlp
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.1)
    return block.to(dtype).eval()


def hf_routed_experts(block, x: torch.Tensor) -> torch.Tensor:
    """The experts the block's router picks for each row of x, in its order."""
    with torch.no_grad():
        return block.gate(x)[2]


def hf_experts_output(block, x: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum alone (Qwen2-MoE adds its shared expert after it)."""
    with torch.no_grad():
        _, weights, experts = block.gate(x)
        return block.experts(x, experts, weights)


def op_arguments(block) -> tuple:
    return block.gate.weight.detach(), block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()


@pytest.mark.parametrize(("model_type", "normalize", "round_weights"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_routing_picks_the_experts_hf_picks(model_type, normalize, round_weights):
    block = hf_block(model_type)
    x = torch.randn(TOKENS, 64)
    router_weight, _, _ = op_arguments(block)
    _, experts = route(x, router_weight, 2, normalize, torch.float32)
    assert torch.equal(experts, hf_routed_experts(block, x))


@pytest.mark.parametrize(("model_type", "normalize", "round_weights"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_float32_output_equals_hf_experts(model_type, normalize, round_weights):
    block = hf_block(model_type)
    x = torch.randn(TOKENS, 64)
    result = octavo.moe(x, *op_arguments(block), 2, normalize, "silu", round_weights)
    torch.testing.assert_close(result, hf_experts_output(block, x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("model_type", "normalize", "round_weights"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_bfloat16_output_within_hfs_rounding(model_type, normalize, round_weights):
    """HF adds each expert's bf16 contribution into a bf16 buffer; the op sums the slots in float32 and rounds
    once: they differ by the rounding of one addition, half a bf16 ulp of the output per slot after the first."""
    block = hf_block(model_type, torch.bfloat16)
    x = torch.randn(TOKENS, 64).to(torch.bfloat16)
    result = octavo.moe(x, *op_arguments(block), 2, normalize, "silu", round_weights)
    expected = hf_experts_output(block, x)
    assert result.dtype == torch.bfloat16
    ulp = torch.exp2(torch.floor(torch.log2(expected.float().abs().clamp_min(1e-30))) - 7)
    assert ((result.float() - expected.float()).abs() <= ulp + 1e-6).all()


def test_unrounded_weights_are_mixtrals_float32_products():
    """Mixtral keeps its routing weights float32: rounding them to bf16 is a different (slightly) result."""
    block = hf_block("mixtral", torch.bfloat16)
    x = torch.randn(TOKENS, 64).to(torch.bfloat16)
    unrounded = octavo.moe(x, *op_arguments(block), 2, True, "silu", False)
    rounded = octavo.moe(x, *op_arguments(block), 2, True, "silu", True)
    assert not torch.equal(unrounded, rounded)


@pytest.mark.parametrize(("layout", "group_size"), [("w8", None), ("w8", 32), ("w4", 32)])
def test_quantized_experts_compute_on_their_dequantized_weights(layout, group_size):
    block = hf_block("qwen3_moe")
    router_weight, gate_up, down = op_arguments(block)
    parts = {name: [rtn(layout, expert, group_size) for expert in weight] for name, weight in
             (("gate_up", gate_up), ("down", down))}

    def stacked(name: str, field: str):
        values = [getattr(part, field) for part in parts[name]]
        return None if values[0] is None else torch.stack(values)

    x = torch.randn(TOKENS, 64)
    quantized = octavo.moe(x, router_weight, stacked("gate_up", "qweight"), stacked("down", "qweight"), 2, True,
                           "silu", True, stacked("gate_up", "scales"), stacked("gate_up", "offsets"),
                           stacked("down", "scales"), stacked("down", "offsets"), group_size or 0)
    dequantized = [torch.stack([part.dequantize() for part in parts[name]]) for name in ("gate_up", "down")]
    assert torch.equal(quantized, moe_reference(x, router_weight, *dequantized, 2, True))


def test_equal_probabilities_go_to_the_lower_expert():
    router_weight = torch.zeros(4, 8)  # every expert equally likely for every token
    _, experts = route(torch.randn(5, 8), router_weight, 2, False, torch.float32)
    assert experts.tolist() == [[0, 1]] * 5


def test_fake_impl_gives_the_real_shape_and_dtype():
    block = hf_block("olmoe", torch.bfloat16)
    x = torch.randn(6, 64).to(torch.bfloat16)
    arguments = op_arguments(block)
    real = octavo.moe(x, *arguments, 2, False)
    with FakeTensorMode() as mode:
        fake = octavo.moe(mode.from_tensor(x), *(mode.from_tensor(t) for t in arguments), 2, False)
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)
