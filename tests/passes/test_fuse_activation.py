"""fuse_activation: silu(gate) * up over the merged gate/up projection -> octavo.silu_and_mul."""

from __future__ import annotations

import pytest
import torch

from octavo.errors import PassError
from tests.passes.fusion_harness import (
    BASE_PASSES,
    DTYPES,
    MODEL_TYPES,
    assert_bitwise_equal,
    compiled,
    outputs,
    passes_before,
    passes_through,
)
from tests.tiny_models import COMMON

LAYERS = COMMON["num_hidden_layers"]
PASS = "fuse_activation"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_op_counts_before_and_after(model_type):
    before = compiled(model_type, "float32", passes_before(PASS))
    after = compiled(model_type, "float32", passes_through(PASS))
    assert (before.count("aten.silu"), after.count("aten.silu")) == (LAYERS, 0)
    assert (before.count("octavo.silu_and_mul"), after.count("octavo.silu_and_mul")) == (0, LAYERS)
    assert after.count("aten.mul") == before.count("aten.mul") - LAYERS
    # The gate/up split went with it: only the q/k/v splits are left.
    assert after.count("aten.split_with_sizes") == before.count("aten.split_with_sizes") - LAYERS
    assert after.stats(PASS) == {"silu_and_mul": LAYERS, "unmerged": 0}
    for node in after.graph_module.graph.nodes:
        if node.target is torch.ops.octavo.silu_and_mul.default:
            assert node.args[0].target is torch.ops.aten.linear.default
            assert node.args[0].args[1].name.endswith("gate_up_proj_weight")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_outputs_bitwise_equal_before_and_after(model_type, dtype):
    assert_bitwise_equal(outputs(model_type, dtype, passes_before(PASS)),
                         outputs(model_type, dtype, passes_through(PASS)))


def test_with_fuse_gate_up_disabled_the_activations_stay_and_are_counted():
    result = compiled("llama", "float32", (*BASE_PASSES, "fuse_gate_up", PASS), ("fuse_gate_up",))
    assert result.stats(PASS) == {"silu_and_mul": 0, "unmerged": LAYERS}
    assert result.count("aten.silu") == LAYERS


def test_unmerged_activations_with_fuse_gate_up_enabled_are_an_error():
    with pytest.raises(PassError, match="matched none of 2 activation nodes"):
        compiled("llama", "float32", (*BASE_PASSES, PASS))


def test_no_silu_at_all_is_an_error():
    with pytest.raises(PassError, match="found no gated activation"):
        compiled("llama", "float32", (*passes_through(PASS), PASS))
