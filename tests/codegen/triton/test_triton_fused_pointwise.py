"""Generated Triton kernels for fused_pointwise programs against the op's reference interpreter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.fx import Graph, GraphModule
from triton_test_utils import assert_close_for_dtype

from octavo.codegen.lowering import lower_graph
from octavo.codegen.triton_backend.fused_pointwise import fused_pointwise, kernel_cache_dir, load_kernel
from octavo.codegen.triton_backend.pointwise_codegen import generate_source, kernel_name
from octavo.codegen.triton_backend.pointwise_ops import ELEMENTWISE, REDUCTIONS
from octavo.errors import OctavoError
from octavo.ir.ops.fused_pointwise import ALLOWED_OPS, REDUCTION_OPS, Reference, encode_program, evaluate_program

# Padding columns (masked, never stored) may compute log(0) or 1/0 in the interpreter's numpy.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

X, Y, Z = Reference("input", 0), Reference("input", 1), Reference("input", 2)


def step(index: int) -> Reference:
    return Reference("step", index)


def rms_norm_program(dtype: torch.dtype) -> str:
    """HF's decomposed RMSNorm, as the partitioner would hand it over."""
    return encode_program([
        {"op": "aten._to_copy.default", "args": [X], "kwargs": {"dtype": torch.float32}},
        {"op": "aten.pow.Tensor_Scalar", "args": [step(0), 2]},
        {"op": "aten.mean.dim", "args": [step(1), [-1], True]},
        {"op": "aten.add.Tensor", "args": [step(2), 1e-6]},
        {"op": "aten.rsqrt.default", "args": [step(3)]},
        {"op": "aten.mul.Tensor", "args": [step(0), step(4)]},
        {"op": "aten._to_copy.default", "args": [step(5)], "kwargs": {"dtype": dtype}},
        {"op": "aten.mul.Tensor", "args": [Y, step(6)]},
    ])


def run(program: str, inputs: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    expected = evaluate_program(inputs, program)
    actual = fused_pointwise([tensor.to(device) for tensor in inputs], program)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    return actual.cpu(), expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens", [1, 6, 300])
def test_rms_norm_program_with_reduction(num_tokens, dtype, device):
    generator = torch.Generator().manual_seed(num_tokens)
    x = (3 * torch.randn(1, num_tokens, 96, generator=generator)).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=generator)).to(dtype)
    actual, expected = run(rms_norm_program(dtype), [x, weight], device)
    assert_close_for_dtype(actual, expected, dtype)


def test_broadcasts_along_leading_and_last_dims(device):
    # x [1, T, H] (H over more than one column block); a per-row scale [1, T, 1] (column stride 0);
    # a weight [H] (row stride 0); a 0-dim scalar.
    generator = torch.Generator().manual_seed(0)
    x, row_scale = torch.randn(1, 3, 1100, generator=generator), torch.randn(1, 3, 1, generator=generator)
    weight, scalar = torch.randn(1100, generator=generator), torch.tensor(0.25)
    program = encode_program([
        {"op": "aten.mul.Tensor", "args": [X, Y]},
        {"op": "aten.mul.Tensor", "args": [step(0), Z]},
        {"op": "aten.sub.Tensor", "args": [step(1), Reference("input", 3)]},
    ])
    actual, expected = run(program, [x, row_scale, weight, scalar], device)
    assert_close_for_dtype(actual, expected, torch.float32)


def _single_op_program(name: str) -> tuple[str, int]:
    """A one-step program of op `name` and the number of inputs it reads."""
    if name in ("aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.maximum.default",
                "aten.minimum.default"):
        return encode_program([{"op": name, "args": [X, Y]}]), 2
    if name == "aten.pow.Tensor_Scalar":
        return encode_program([{"op": name, "args": [X, 3]}]), 1
    if name == "aten._to_copy.default":
        return encode_program([{"op": name, "args": [X], "kwargs": {"dtype": torch.bfloat16}}]), 1
    if name == "aten.gelu.default":
        return encode_program([{"op": name, "args": [X], "kwargs": {"approximate": "tanh"}}]), 1
    if name in REDUCTION_OPS:
        return encode_program([{"op": name, "args": [X, [-1], True]}]), 1
    return encode_program([{"op": name, "args": [X]}]), 1


@pytest.mark.parametrize("name", sorted(ALLOWED_OPS))
def test_every_allowed_op(name, device):
    program, num_inputs = _single_op_program(name)
    generator = torch.Generator().manual_seed(len(name))
    # Positive inputs (log, sqrt, rsqrt need them), spread enough for exp/tanh/sigmoid to matter.
    inputs = [0.2 + 2 * torch.rand(2, 3, 40, generator=generator) for _ in range(num_inputs)]
    actual, expected = run(program, inputs, device)
    assert_close_for_dtype(actual, expected, expected.dtype)


def test_every_allowed_op_has_a_translation():
    assert set(ALLOWED_OPS) <= set(ELEMENTWISE) | set(REDUCTIONS)


def test_bf16_steps_round_where_torch_rounds(device):
    # Each step rounds to bf16 as the unfused ops do, so add/mul/sub chains are bitwise equal.
    generator = torch.Generator().manual_seed(2)
    x, y, z = (torch.randn(1, 4, 64, generator=generator).to(torch.bfloat16) for _ in range(3))
    program = encode_program([
        {"op": "aten.mul.Tensor", "args": [X, Y]},
        {"op": "aten.add.Tensor", "args": [step(0), Z]},
        {"op": "aten.sub.Tensor", "args": [step(1), X]},
        {"op": "aten.mul.Tensor", "args": [step(2), 3.0]},
    ])
    actual, expected = run(program, [x, y, z], device)
    assert torch.equal(actual, expected)


def test_mixed_dtypes_promote_like_torch(device):
    x = torch.randn(1, 3, 32).to(torch.bfloat16)
    weight = torch.randn(32)
    program = encode_program([{"op": "aten.mul.Tensor", "args": [X, Y]}, {"op": "aten.exp.default", "args": [step(0)]}])
    actual, expected = run(program, [x, weight], device)
    assert expected.dtype == torch.float32
    assert_close_for_dtype(actual, expected, torch.float32)


@pytest.mark.parametrize("reduction", sorted(REDUCTION_OPS))
def test_per_row_results(reduction, device):
    # A reduction as the last step: one value per row ([..., 1]), after a pointwise prologue.
    x = torch.randn(2, 5, 70, generator=torch.Generator().manual_seed(4))
    program = encode_program([{"op": "aten.abs.default", "args": [X]}, {"op": reduction, "args": [step(0), [-1], True]},
                              {"op": "aten.mul.Tensor", "args": [step(1), 0.5]}])
    actual, expected = run(program, [x], device)
    assert actual.shape == (2, 5, 1)
    assert_close_for_dtype(actual, expected, torch.float32)


def test_source_is_a_function_of_the_program_only():
    program = rms_norm_program(torch.bfloat16)
    source = generate_source(program)
    assert source == generate_source(program)
    assert f"def {kernel_name(program)}(" in source
    assert source.isascii()
    other = rms_norm_program(torch.float32)
    assert kernel_name(other) != kernel_name(program) and generate_source(other) != source


def test_kernel_is_imported_from_the_cache_dir(device):
    program = encode_program([{"op": "aten.neg.default", "args": [X]}])
    kernel = load_kernel(program)
    path = kernel_cache_dir() / f"{kernel_name(program)}.py"
    assert path.read_text() == generate_source(program)
    module = sys.modules[f"octavo_generated_{kernel_name(program)}"]
    assert Path(module.__file__).resolve() == path.resolve()
    assert getattr(module, kernel_name(program)) is kernel
    x = torch.randn(3, 8)
    assert torch.equal(fused_pointwise([x.to(device)], program).cpu(), -x)


def test_unknown_op_is_rejected():
    program = '[{"op": "aten.embedding.default", "args": [{"input": 0}, {"input": 1}]}]'
    with pytest.raises(OctavoError, match=r"aten\.embedding\.default"):
        generate_source(program)


def test_lowering_generates_the_kernel_at_load(device):
    program = encode_program([{"op": "aten.sigmoid.default", "args": [X]},
                              {"op": "aten.mul.Tensor", "args": [step(0), Y]}])
    graph = Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    graph.output(graph.call_function(torch.ops.octavo.fused_pointwise.default, ([x, y], program)))
    module_name = f"octavo_generated_{kernel_name(program)}"
    assert module_name not in sys.modules
    lowered = lower_graph(GraphModule(torch.nn.Module(), graph), "triton")
    assert module_name in sys.modules  # imported by lower_graph, before the first call
    inputs = [torch.randn(2, 33), torch.randn(33)]
    assert_close_for_dtype(lowered(*[tensor.to(device) for tensor in inputs]), evaluate_program(inputs, program),
                           torch.float32)
