"""octavo.fused_pointwise: the program format (JSON data, allow-listed ops) and its evaluation."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from octavo.errors import OctavoError
from octavo.ir.ops.fused_pointwise import ALLOWED_OPS, REDUCTION_OPS, Reference, decode_program, encode_program

octavo = torch.ops.octavo
aten = torch.ops.aten
INPUT0, INPUT1 = Reference("input", 0), Reference("input", 1)


def rms_norm_program(dtype: torch.dtype) -> str:
    """LlamaRMSNorm's decomposition as a program over inputs (x, weight)."""
    return encode_program([
        {"op": "aten._to_copy.default", "args": [INPUT0], "kwargs": {"dtype": torch.float32}},
        {"op": "aten.pow.Tensor_Scalar", "args": [Reference("step", 0), 2]},
        {"op": "aten.mean.dim", "args": [Reference("step", 1), [-1], True]},
        {"op": "aten.add.Tensor", "args": [Reference("step", 2), 1e-6]},
        {"op": "aten.rsqrt.default", "args": [Reference("step", 3)]},
        {"op": "aten.mul.Tensor", "args": [Reference("step", 0), Reference("step", 4)]},
        {"op": "aten._to_copy.default", "args": [Reference("step", 5)], "kwargs": {"dtype": dtype}},
        {"op": "aten.mul.Tensor", "args": [INPUT1, Reference("step", 6)]},
    ])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_program_equals_the_ops_it_lists_bitwise(dtype):
    x, weight = torch.randn(1, 9, 96).to(dtype), torch.rand(96).to(dtype)
    hidden = x.to(torch.float32)
    expected = weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    result = octavo.fused_pointwise([x, weight], rms_norm_program(dtype))
    assert result.dtype == dtype and torch.equal(result, expected)


def test_program_is_plain_json_with_documented_argument_forms():
    program = encode_program([
        {"op": "aten.maximum.default", "args": [INPUT0, INPUT1]},
        {"op": "aten.add.Tensor", "args": [Reference("step", 0), float("-inf")]},
        {"op": "aten._to_copy.default", "args": [Reference("step", 1)], "kwargs": {"dtype": torch.bfloat16}},
    ])
    assert json.loads(program) == [
        {"op": "aten.maximum.default", "args": [{"input": 0}, {"input": 1}]},
        {"op": "aten.add.Tensor", "args": [{"step": 0}, {"float": "-inf"}]},
        {"op": "aten._to_copy.default", "args": [{"step": 1}], "kwargs": {"dtype": {"dtype": "bfloat16"}}},
    ]
    steps = decode_program(program)
    assert [step.op for step in steps] == [aten.maximum.default, aten.add.Tensor, aten._to_copy.default]
    assert steps[1].args[1] == float("-inf") and steps[2].kwargs == {"dtype": torch.bfloat16}


def test_ints_and_floats_stay_apart():
    program = encode_program([{"op": "aten.pow.Tensor_Scalar", "args": [INPUT0, 2]},
                              {"op": "aten.mul.Tensor", "args": [Reference("step", 0), 2.0]}])
    steps = decode_program(program)
    assert type(steps[0].args[1]) is int and type(steps[1].args[1]) is float


@pytest.mark.parametrize(("steps", "message"), [
    ([{"op": "builtins.eval", "args": ["1"]}], "not allowed"),
    ([{"op": "aten.index_put.default", "args": [{"input": 0}]}], "not allowed"),
    ([{"op": "aten.neg.default", "args": [{"step": 0}]}], "malformed argument"),
    ([{"op": "aten.neg.default", "args": [{"input": -1}]}], "malformed argument"),
    ([{"op": "aten.add.Tensor", "args": [{"input": 0}, 1], "kwargs": {"alpha": 2}}], "keyword"),
    ([{"op": "aten.mean.dim", "args": [{"input": 0}, [0], True]}], "reduce dim [-1]"),
    ([{"op": "aten.sum.dim_IntList", "args": [{"input": 0}, [-1], False]}], "keepdim"),
    ([{"op": "aten.amax.default", "args": [{"input": 0}, [-1], True]},
      {"op": "aten.mean.dim", "args": [{"step": 0}, [-1], True]}], "2 reductions"),
    ([], "non-empty"),
    ([{"op": "aten.neg.default", "args": [{"dtype": "os.system"}]}], "malformed argument"),
])
def test_malformed_programs_are_rejected(steps, message):
    with pytest.raises(OctavoError, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode_program(json.dumps(steps))


def test_text_that_is_not_json_is_rejected():
    with pytest.raises(OctavoError, match="not JSON"):
        decode_program("__import__('os')")


def test_fake_impl_gives_the_real_shape_and_dtype():
    x, weight = torch.randn(1, 4, 32).to(torch.bfloat16), torch.rand(32).to(torch.bfloat16)
    program = rms_norm_program(torch.bfloat16)
    real = octavo.fused_pointwise([x, weight], program)
    with FakeTensorMode() as mode:
        fake = octavo.fused_pointwise([mode.from_tensor(x), mode.from_tensor(weight)], program)
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


def test_allow_list_holds_only_pointwise_ops_and_row_reductions():
    # _to_copy carries no pointwise tag in ATen, but with only `dtype` (all a step may pass) it is an elementwise cast.
    elementwise = {"aten._to_copy.default"} | set(REDUCTION_OPS)
    for name, op in ALLOWED_OPS.items():
        assert name == f"{op.namespace}.{op._opname}.{op._overloadname}"
        assert torch.Tag.pointwise in op.tags or name in elementwise, name


def test_schema_follows_the_op_contract():
    assert str(octavo.fused_pointwise.default._schema) == (
        "octavo::fused_pointwise(Tensor[] inputs, str program) -> Tensor")
