"""How each ATen op of a fused_pointwise program reads as a Triton expression (text only, no Triton import).

Operands are float32 Triton values (or int1 for predicates); the generated
kernel rounds every float step to the step's own dtype afterwards, so the
expressions here only compute in float32. Reductions (sum, mean, amax,
amin over the last dim) are listed apart: they turn a row of values into
one value per row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from octavo.errors import OctavoError


@dataclass(frozen=True)
class Operand:
    """One argument of a step, as Triton source text."""

    text: str
    extent: str = "vector"  # "vector": varies along the row; "row": one value per row; "literal": a constant
    is_bool: bool = False
    value: object = None    # the Python value of a literal

    @property
    def as_float(self) -> str:
        return f"({self.text}).to(tl.float32)" if self.is_bool else self.text

    @property
    def as_bool(self) -> str:
        return self.text if self.is_bool else f"({self.text} != 0)"


def literal(value) -> Operand:
    """A JSON literal as a Triton constant (numbers in float32 context)."""
    if isinstance(value, bool):
        return Operand("1.0" if value else "0.0", "literal", value=value)
    if isinstance(value, (int, float)):
        number = float(value)
        if math.isnan(number):
            return Operand('float("nan")', "literal", value=value)
        if math.isinf(number):
            return Operand('float("inf")' if number > 0 else '-float("inf")', "literal", value=value)
        return Operand(repr(number), "literal", value=value)
    raise OctavoError(f"fused_pointwise: cannot use {value!r} as an operand")


def _binary(symbol: str) -> Callable:
    return lambda args, kwargs: f"({args[0].as_float} {symbol} {args[1].as_float})"


def _add(sign: str) -> Callable:
    def emit(args, kwargs):
        alpha = kwargs.get("alpha", 1)
        other = args[1].as_float if alpha == 1 else f"({float(alpha)!r} * {args[1].as_float})"
        return f"({args[0].as_float} {sign} {other})"
    return emit


def _compare(symbol: str) -> Callable:
    return lambda args, kwargs: f"({args[0].as_float} {symbol} {args[1].as_float})"


def _unary(template: str) -> Callable:
    return lambda args, kwargs: template.format(x=args[0].as_float)


def _pow_scalar(args, kwargs) -> str:
    base, exponent = args[0].as_float, float(args[1].value)
    if exponent == 0.5:
        return f"tl.sqrt({base})"
    if exponent == -0.5:
        return f"tl.rsqrt({base})"
    if exponent.is_integer() and 0 < abs(exponent) <= 4:
        product = " * ".join([base] * int(abs(exponent)))
        return f"({product})" if exponent > 0 else f"(1.0 / ({product}))"
    if exponent == 0:
        return f"({base} * 0.0 + 1.0)"
    return f"tl.exp2({exponent!r} * tl.log2({base}))"


def _gelu(args, kwargs) -> str:
    x = args[0].as_float
    if kwargs.get("approximate", "none") == "tanh":
        inner = f"0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})"
        return f"(0.5 * {x} * (2.0 * tl.sigmoid(2.0 * ({inner}))))"
    return f"(0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476)))"


def _clamp(args, kwargs) -> str:
    low = args[1] if len(args) > 1 else kwargs.get("min")
    high = args[2] if len(args) > 2 else kwargs.get("max")
    text = args[0].as_float
    if low is not None:
        text = f"tl.maximum({text}, {_text(low)})"
    if high is not None:
        text = f"tl.minimum({text}, {_text(high)})"
    return text


def _text(value) -> str:
    return value.as_float if isinstance(value, Operand) else literal(value).text


def _where(args, kwargs) -> str:
    return f"tl.where({args[0].as_bool}, {args[1].as_float}, {args[2].as_float})"


def _identity(args, kwargs) -> str:
    return args[0].as_float


# Elementwise ops: name -> (emitter, result is a predicate). Casts are identities here: the
# kernel rounds each step to its dtype, which is exactly what a cast does.
ELEMENTWISE: dict[str, tuple[Callable, bool]] = {
    "aten.add.Tensor": (_add("+"), False),
    "aten.add.Scalar": (_add("+"), False),
    "aten.sub.Tensor": (_add("-"), False),
    "aten.sub.Scalar": (_add("-"), False),
    "aten.rsub.Scalar": (lambda a, k: f"({a[1].as_float} - {a[0].as_float})", False),
    "aten.rsub.Tensor": (lambda a, k: f"({a[1].as_float} - {a[0].as_float})", False),
    "aten.mul.Tensor": (_binary("*"), False),
    "aten.mul.Scalar": (_binary("*"), False),
    "aten.div.Tensor": (_binary("/"), False),
    "aten.div.Scalar": (_binary("/"), False),
    "aten.pow.Tensor_Scalar": (_pow_scalar, False),
    "aten.maximum.default": (lambda a, k: f"tl.maximum({a[0].as_float}, {a[1].as_float})", False),
    "aten.minimum.default": (lambda a, k: f"tl.minimum({a[0].as_float}, {a[1].as_float})", False),
    "aten.where.self": (_where, False),
    "aten.clamp.default": (_clamp, False),
    "aten.neg.default": (_unary("(-{x})"), False),
    "aten.abs.default": (_unary("tl.abs({x})"), False),
    "aten.exp.default": (_unary("tl.exp({x})"), False),
    "aten.log.default": (_unary("tl.log({x})"), False),
    "aten.sqrt.default": (_unary("tl.sqrt({x})"), False),
    "aten.rsqrt.default": (_unary("tl.rsqrt({x})"), False),
    "aten.reciprocal.default": (_unary("(1.0 / {x})"), False),
    "aten.sin.default": (_unary("tl.sin({x})"), False),
    "aten.cos.default": (_unary("tl.cos({x})"), False),
    "aten.erf.default": (_unary("tl.erf({x})"), False),
    "aten.tanh.default": (_unary("(2.0 * tl.sigmoid(2.0 * {x}) - 1.0)"), False),
    "aten.sigmoid.default": (_unary("tl.sigmoid({x})"), False),
    "aten.silu.default": (_unary("({x} * tl.sigmoid({x}))"), False),
    "aten.relu.default": (_unary("tl.maximum({x}, 0.0)"), False),
    "aten.gelu.default": (_gelu, False),
    "aten.clone.default": (_identity, False),
    "aten.alias.default": (_identity, False),
    "aten._to_copy.default": (_identity, False),
    "aten.to.dtype": (_identity, False),
    "prims.convert_element_type.default": (_identity, False),
    "aten.eq.Tensor": (_compare("=="), True),
    "aten.eq.Scalar": (_compare("=="), True),
    "aten.ne.Tensor": (_compare("!="), True),
    "aten.ne.Scalar": (_compare("!="), True),
    "aten.lt.Tensor": (_compare("<"), True),
    "aten.lt.Scalar": (_compare("<"), True),
    "aten.le.Tensor": (_compare("<="), True),
    "aten.le.Scalar": (_compare("<="), True),
    "aten.gt.Tensor": (_compare(">"), True),
    "aten.gt.Scalar": (_compare(">"), True),
    "aten.ge.Tensor": (_compare(">="), True),
    "aten.ge.Scalar": (_compare(">="), True),
    "aten.logical_not.default": (lambda a, k: f"({a[0].as_bool} == 0)", True),
    "aten.logical_and.default": (lambda a, k: f"({a[0].as_bool} & {a[1].as_bool})", True),
    "aten.logical_or.default": (lambda a, k: f"({a[0].as_bool} | {a[1].as_bool})", True),
}

# Reductions over the last dim: name -> (Triton reduction, value that padding columns hold, divide by n).
REDUCTIONS: dict[str, tuple[str, str, bool]] = {
    "aten.sum.dim_IntList": ("tl.sum", "0.0", False),
    "aten.mean.dim": ("tl.sum", "0.0", True),
    "aten.amax.default": ("tl.max", '-float("inf")', False),
    "aten.amin.default": ("tl.min", 'float("inf")', False),
}

SUPPORTED_OPS = frozenset(ELEMENTWISE) | frozenset(REDUCTIONS)


def reduction_dims(step_args: tuple, step_kwargs: dict):
    """The `dim` argument of a reduction step (positional 1 or keyword)."""
    if len(step_args) > 1:
        return step_args[1]
    return step_kwargs.get("dim")
