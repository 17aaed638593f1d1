"""octavo::fused_pointwise: a group of pointwise ATen ops (plus at most one last-dim reduction) as one op.

The group is carried as a *program*: a JSON string (data, never code) listing
the steps in order. A step is ``{"op": NAME, "args": [...], "kwargs": {...}}``
(``kwargs`` optional), NAME being ``namespace.name.overload`` of an allowed
ATen op (``"aten.mul.Tensor"``, ``"aten.rsqrt.default"``). Arguments are

- ``{"input": i}``: the i-th tensor of the op's ``inputs`` list,
- ``{"step": j}``: the result of an earlier step j,
- ``{"dtype": "bfloat16"}``: a torch dtype,
- ``{"float": "inf"}`` / ``"-inf"`` / ``"nan"``: a non-finite float,
- JSON literals: ints, finite floats (JSON keeps ``2`` and ``2.0`` apart),
  booleans, null, strings, and lists of these.

The op's result is the last step's result. Only the ops in ALLOWED_OPS may
appear; a reduction (REDUCTION_OPS) must reduce the last dim with
keepdim=True, so every backend can run a group row by row.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from octavo.errors import OctavoError

aten = torch.ops.aten

POINTWISE_OPS: dict[str, torch._ops.OpOverload] = {
    "aten.add.Tensor": aten.add.Tensor,
    "aten.sub.Tensor": aten.sub.Tensor,
    "aten.mul.Tensor": aten.mul.Tensor,
    "aten.div.Tensor": aten.div.Tensor,
    "aten.neg.default": aten.neg.default,
    "aten.reciprocal.default": aten.reciprocal.default,
    "aten.rsqrt.default": aten.rsqrt.default,
    "aten.sqrt.default": aten.sqrt.default,
    "aten.exp.default": aten.exp.default,
    "aten.log.default": aten.log.default,
    "aten.cos.default": aten.cos.default,
    "aten.sin.default": aten.sin.default,
    "aten.tanh.default": aten.tanh.default,
    "aten.sigmoid.default": aten.sigmoid.default,
    "aten.silu.default": aten.silu.default,
    "aten.gelu.default": aten.gelu.default,
    "aten.relu.default": aten.relu.default,
    "aten.abs.default": aten.abs.default,
    "aten.maximum.default": aten.maximum.default,
    "aten.minimum.default": aten.minimum.default,
    "aten.pow.Tensor_Scalar": aten.pow.Tensor_Scalar,
    "aten._to_copy.default": aten._to_copy.default,
}
REDUCTION_OPS: dict[str, torch._ops.OpOverload] = {
    "aten.mean.dim": aten.mean.dim,
    "aten.sum.dim_IntList": aten.sum.dim_IntList,
    "aten.amax.default": aten.amax.default,
}
ALLOWED_OPS = {**POINTWISE_OPS, **REDUCTION_OPS}
# The keyword arguments a step may carry, per op (all others take positional arguments only).
ALLOWED_KWARGS = {"aten._to_copy.default": {"dtype"}, "aten.gelu.default": {"approximate"}}


@torch.library.custom_op("octavo::fused_pointwise", mutates_args=())
def fused_pointwise(inputs: list[Tensor], program: str) -> Tensor:
    """Run ``program`` (see the module docstring) on ``inputs`` and return its last step's result.

    Every step is the named ATen op applied to its decoded arguments, in
    order, with torch's own broadcasting and type promotion; so the result
    equals, bit for bit on the same backend, what the unfused ops computed.
    Shapes: any tensors that broadcast together; at most one step is a
    reduction, over the last dim with keepdim=True.
    """
    return evaluate_program(inputs, program)


@fused_pointwise.register_fake
def _(inputs, program):
    return evaluate_program(inputs, program)


@dataclass(frozen=True)
class Step:
    """One decoded step: the op and its arguments, references still symbolic (see `bind`)."""

    name: str
    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class Reference:
    """An argument that names an input ("input") or an earlier step's result ("step")."""

    kind: str
    index: int


def evaluate_program(inputs: list[Tensor], program: str) -> Tensor:
    """The reference interpreter: each step's ATen op, in order."""
    results: list[Tensor] = []
    for step in decode_program(program):
        args = bind(step.args, inputs, results)
        kwargs = {key: bind(value, inputs, results) for key, value in step.kwargs.items()}
        results.append(step.op(*args, **kwargs))
    return results[-1]


def bind(value: Any, inputs: list[Tensor], results: list[Tensor]) -> Any:
    """Replace References in `value` (a decoded argument) by the tensors they name."""
    if isinstance(value, Reference):
        return inputs[value.index] if value.kind == "input" else results[value.index]
    if isinstance(value, tuple):
        return tuple(bind(item, inputs, results) for item in value)
    if isinstance(value, list):
        return [bind(item, inputs, results) for item in value]
    return value


@functools.lru_cache(maxsize=4096)
def decode_program(program: str) -> tuple[Step, ...]:
    """Parse and validate a program; OctavoError naming the problem if it is malformed."""
    try:
        raw_steps = json.loads(program)
    except json.JSONDecodeError as error:
        raise OctavoError(f"fused_pointwise program is not JSON: {error}") from error
    if not isinstance(raw_steps, list) or not raw_steps:
        raise OctavoError("fused_pointwise program must be a non-empty list of steps")
    steps = []
    for index, raw in enumerate(raw_steps):
        steps.append(_decode_step(raw, index))
    reductions = sum(1 for step in steps if step.name in REDUCTION_OPS)
    if reductions > 1:
        raise OctavoError(f"fused_pointwise program has {reductions} reductions; at most one is allowed")
    return tuple(steps)


def encode_program(steps: list[dict]) -> str:
    """The JSON text of a program given as ``[{"op": name, "args": [...], "kwargs": {...}}, ...]``.

    Arguments may hold Reference objects, torch dtypes, non-finite floats and
    JSON literals; the result is validated by decoding it.
    """
    encoded = []
    for step in steps:
        item = {"op": step["op"], "args": [_encode_value(arg) for arg in step["args"]]}
        if step.get("kwargs"):
            item["kwargs"] = {key: _encode_value(value) for key, value in step["kwargs"].items()}
        encoded.append(item)
    text = json.dumps(encoded, separators=(",", ":"))
    decode_program(text)
    return text


def _encode_value(value: Any) -> Any:
    if isinstance(value, Reference):
        return {value.kind: value.index}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, list | tuple):
        return [_encode_value(item) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise OctavoError(f"fused_pointwise cannot encode argument {value!r} of type {type(value).__name__}")


def _decode_step(raw: Any, index: int) -> Step:
    if not isinstance(raw, dict) or set(raw) - {"op", "args", "kwargs"} or not isinstance(raw.get("args"), list):
        raise OctavoError(f"fused_pointwise step {index} is malformed: {raw!r}")
    name = raw.get("op")
    if name not in ALLOWED_OPS:
        raise OctavoError(f"fused_pointwise step {index} uses op {name!r}, which is not allowed")
    kwargs = raw.get("kwargs", {})
    if not isinstance(kwargs, dict) or set(kwargs) - ALLOWED_KWARGS.get(name, set()):
        raise OctavoError(f"fused_pointwise step {index} ({name}) has unexpected keyword arguments {kwargs!r}")
    args = tuple(_decode_value(arg, index) for arg in raw["args"])
    step = Step(name, ALLOWED_OPS[name], args, {key: _decode_value(value, index) for key, value in kwargs.items()})
    if name in REDUCTION_OPS:
        _check_reduction(step, index)
    return step


def _decode_value(value: Any, step_index: int) -> Any:
    if isinstance(value, list):
        return [_decode_value(item, step_index) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((kind, payload),) = value.items()
        if kind == "input" and type(payload) is int and payload >= 0:
            return Reference("input", payload)
        if kind == "step" and type(payload) is int and 0 <= payload < step_index:
            return Reference("step", payload)
        if kind == "dtype" and isinstance(getattr(torch, str(payload), None), torch.dtype):
            return getattr(torch, payload)
        if kind == "float" and payload in ("inf", "-inf", "nan"):
            return float(payload)
    raise OctavoError(f"fused_pointwise step {step_index} has a malformed argument {value!r}")


def _check_reduction(step: Step, index: int) -> None:
    """A reduction must read a tensor and reduce exactly the last dim (-1) keeping it."""
    if len(step.args) != 3 or step.args[1] != [-1] or step.args[2] is not True:
        raise OctavoError(f"fused_pointwise step {index} ({step.name}) must reduce dim [-1] with keepdim=True, "
                          f"got arguments {step.args[1:]}")
