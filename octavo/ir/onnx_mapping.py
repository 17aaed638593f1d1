"""What graph.onnx is made of: its format constants, dtypes, and ATen -> standard ONNX op rules.

graph.onnx stores an FX graph. Every FX call becomes one ONNX node named like the FX node,
whose outputs are named like the FX values it produces. Each node carries, as JSON in its
``doc_string``, a *template* of the FX call it stands for::

    {"target": "aten::view.default", "args": [{"$in": 0}, [1, {"$in": 1}, -1, 16]], "kwargs": {}}

``target`` names the callable exactly (``"<namespace>::<op>.<overload>"`` for torch ops,
``"<module>.<function>"`` for Python functions such as ``"_operator.mul"``), and every
reference to another FX node is ``{"$in": k}``, the k-th input of the ONNX node. The
reader rebuilds the FX graph from templates alone, so it never interprets ONNX semantics
and never evaluates code from the file. The ONNX op only serves readers of the file
(Netron, onnx tools): a standard op (``standard_call``) when one computes exactly the
same values, else a node of domain ``ai.octavo`` named after the op.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch
from onnx import TensorProto
from torch.fx.operator_schemas import normalize_function

from octavo.errors import ArtifactError

CUSTOM_DOMAIN = "ai.octavo"
CUSTOM_DOMAIN_VERSION = 1
STANDARD_OPSET = 18
IR_VERSION = 10  # IR 10 (onnx >= 1.16) covers opset 18 and the float8 element types.

# Keys of ModelProto.metadata_props.
FORMAT_KEY = "octavo.graph_format"
FORMAT_VERSION = "1"
OUTPUT_STRUCTURE_KEY = "octavo.output_structure"  # the FX output's args[0], refs {"$in": k} = graph output k
# Template of the Constant nodes added to feed standard ops; they stand for no FX node.
HELPER_CONSTANT_TEMPLATE = {"helper": "constant"}

TORCH_TO_ONNX_DTYPE: dict[torch.dtype, int] = {
    torch.float32: TensorProto.FLOAT,
    torch.float64: TensorProto.DOUBLE,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.float8_e4m3fn: TensorProto.FLOAT8E4M3FN,
    torch.float8_e4m3fnuz: TensorProto.FLOAT8E4M3FNUZ,
    torch.float8_e5m2: TensorProto.FLOAT8E5M2,
    torch.float8_e5m2fnuz: TensorProto.FLOAT8E5M2FNUZ,
    torch.int8: TensorProto.INT8,
    torch.int16: TensorProto.INT16,
    torch.int32: TensorProto.INT32,
    torch.int64: TensorProto.INT64,
    torch.uint8: TensorProto.UINT8,
    torch.uint16: TensorProto.UINT16,
    torch.uint32: TensorProto.UINT32,
    torch.uint64: TensorProto.UINT64,
    torch.bool: TensorProto.BOOL,
    torch.complex64: TensorProto.COMPLEX64,
    torch.complex128: TensorProto.COMPLEX128,
}

OP_NAMESPACES = ("aten", "octavo", "prims")
"""Namespaces of torch.ops whose ops graph.onnx may name."""
PYTHON_MODULES: dict[str, Any] = {"_operator": operator, "operator": operator, "math": math, "torch": torch}
"""Modules whose functions graph.onnx may name (of torch, only the ``sym_*`` functions)."""


def onnx_dtype(dtype: torch.dtype) -> int:
    """The ONNX TensorProto element type of a torch dtype; ArtifactError when ONNX has none."""
    if dtype not in TORCH_TO_ONNX_DTYPE:
        raise ArtifactError(f"dtype {dtype} has no ONNX element type and cannot be stored in graph.onnx")
    return TORCH_TO_ONNX_DTYPE[dtype]


def onnx_type_string(dtype: torch.dtype) -> str:
    """The ONNX schema type string of a torch dtype, e.g. ``"tensor(bfloat16)"``."""
    return f"tensor({TensorProto.DataType.Name(onnx_dtype(dtype)).lower()})"


# --------------------------------------------------------------------------- standard ONNX ops


@dataclass(frozen=True)
class StandardCall:
    """A standard-domain ONNX node that computes exactly what one FX call computes.

    ``inputs`` are FX nodes (ONNX values of the same name) or constant tensors, which the
    writer emits as Constant nodes; the FX call's template never refers to the constants.
    """

    op_type: str
    inputs: tuple[torch.fx.Node | torch.Tensor, ...]
    attributes: dict[str, Any] = field(default_factory=dict)
    num_outputs: int = 1


def standard_call(node: torch.fx.Node) -> StandardCall | None:
    """The standard ONNX op equivalent to ``node``, or None when there is no exact equivalent.

    A mapping is only made when the FX node's meta carries the tensor dtypes it depends on
    (ONNX ops require equal input types where ATen would promote) and when the ONNX schema
    of opset 18 accepts the input types.
    """
    rule = _RULES.get(node.target)
    if rule is None or any(n.meta.get("val") is None for n in [node, *_nodes_in((node.args, node.kwargs))]):
        return None
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    if normalized is None:
        return None
    call = rule(normalized.kwargs, node)
    return call if call is not None and _schema_accepts(call) else None


def _nodes_in(value: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, found.append)
    return found


def _meta_tensor(value: Any) -> torch.Tensor | None:
    """The fake tensor an FX node is known to produce (node.meta["val"]), or None."""
    meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return meta if isinstance(meta, torch.Tensor) else None


def _scalar_constant(value: Any, dtype: torch.dtype) -> torch.Tensor | None:
    """``value`` as a 0-d tensor of ``dtype`` when ATen computes with exactly that value.

    ATen converts a Python scalar to the op's compute type: the tensor's dtype for float32
    and float64 (so rounding it to that dtype is what ATen does), float32 for float16 and
    bfloat16 (so the scalar must be exact in the narrow dtype), the integer dtype for ints.
    """
    if isinstance(value, bool) != (dtype == torch.bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not dtype.is_floating_point:
        return None
    constant = torch.tensor(value, dtype=dtype)
    if dtype in (torch.float32, torch.float64):
        return constant
    exact = constant.item() == value or (isinstance(value, float) and math.isnan(value))
    return constant if exact else None


def _int_list(values: Any) -> list[int] | None:
    if not isinstance(values, list | tuple) or not all(type(v) is int for v in values):
        return None
    return list(values)


def _is_one(size: int | torch.SymInt) -> bool:
    return type(size) is int and size == 1  # a SymInt comparison would add a guard to the shape env


def _int64(values: list[int] | int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _pointwise(op_type: str, *, bool_result: bool = False, bitwise_op_type: str | None = None):
    """Rule for elementwise ops whose operands (tensors or scalars) share one dtype, like ONNX's."""

    def rule(kw: dict[str, Any], node: torch.fx.Node) -> StandardCall | None:
        if kw.get("alpha", 1) != 1:
            return None
        operands = [kw[name] for name in ("condition", "input", "other", "exponent") if name in kw]
        values = operands[1:] if "condition" in kw else operands
        tensors = [_meta_tensor(v) for v in values if isinstance(v, torch.fx.Node)]
        if not tensors or any(t is None or t.dtype != tensors[0].dtype for t in tensors):
            return None
        dtype = tensors[0].dtype
        if _meta_tensor(node).dtype != (torch.bool if bool_result else dtype):
            return None
        inputs = []
        for operand in operands:
            if not isinstance(operand, torch.fx.Node):
                operand = _scalar_constant(operand, dtype)
                if operand is None:
                    return None
            inputs.append(operand)
        chosen = bitwise_op_type if bitwise_op_type and dtype != torch.bool else op_type
        return StandardCall(chosen, tuple(inputs))

    return rule


def _pow_scalar(kw: dict[str, Any], node: torch.fx.Node) -> StandardCall | None:
    base, exponent = _meta_tensor(kw["input"]), kw["exponent"]
    if base is None or _meta_tensor(node).dtype != base.dtype:
        return None
    constant = _int64(exponent) if type(exponent) is int else _scalar_constant(exponent, base.dtype)
    return None if constant is None else StandardCall("Pow", (kw["input"], constant))


def _same_dtype(op_type: str, names: tuple[str, ...], **attributes: Any):
    def rule(kw: dict[str, Any], node: torch.fx.Node) -> StandardCall | None:
        metas = [_meta_tensor(kw[name]) for name in names]
        if any(m is None or m.dtype != _meta_tensor(node).dtype for m in metas):
            return None
        return StandardCall(op_type, tuple(kw[name] for name in names), dict(attributes))

    return rule


def _to_copy(kw: dict[str, Any], node: torch.fx.Node) -> StandardCall | None:
    others = ("layout", "device", "pin_memory", "memory_format")
    if kw["dtype"] not in TORCH_TO_ONNX_DTYPE or kw["non_blocking"] or any(kw[k] is not None for k in others):
        return None
    return StandardCall("Cast", (kw["input"],), {"to": TORCH_TO_ONNX_DTYPE[kw["dtype"]]})


def _transpose(kw: dict[str, Any], node: torch.fx.Node) -> StandardCall | None:
    rank = _meta_tensor(node).dim()
    if "dims" in kw:
        perm = [d % rank for d in kw["dims"]]
    else:
        perm = list(range(rank))
        first, second = kw["dim0"] % rank, kw["dim1"] % rank
        perm[first], perm[second] = second, first
    return StandardCall("Transpose", (kw["input"],), {"perm": perm})


def _concat(kw: dict[str, Any], node: torch.fx.Node) -> StandardCall | None:
    out = _meta_tensor(node)
    metas = [_meta_tensor(t) for t in kw["tensors"]]
    if any(m is None or m.dtype != out.dtype or m.dim() != out.dim() for m in metas):
        return None
    return StandardCall("Concat", tuple(kw["tensors"]), {"axis": kw["dim"]})


def _gather(kw: dict[str, Any], node: torch.fx.Node) -> StandardCall | None:
    if "weight" in kw:  # embedding: padding_idx and friends only matter for the backward pass
        return StandardCall("Gather", (kw["weight"], kw["indices"]), {"axis": 0})
    index = kw["index"]
    if isinstance(index, torch.fx.Node):
        meta = _meta_tensor(index)
        return StandardCall("Gather", (kw["input"], index), {"axis": kw["dim"]}) if meta.dim() == 1 else None
    return StandardCall("Gather", (kw["input"], _int64(index)), {"axis": kw["dim"]})


def _softmax(op_type: str):
    def rule(kw: dict[str, Any], node: torch.fx.Node) -> StandardCall | None:
        if kw.get("half_to_float") or kw.get("dtype") is not None:
            return None
        return _same_dtype(op_type, ("input",), axis=kw["dim"])(kw, node)

    return rule


def _with_int64_operand(op_type: str, name: str, *, reject_sizes: tuple[int, ...] = ()):
    """Rule for ops whose int-list (or int) argument ``name`` becomes an int64 Constant input."""

    def rule(kw: dict[str, Any], node: torch.fx.Node) -> StandardCall | None:
        value = kw[name]
        values = [value] if type(value) is int else _int_list(value)
        if values is None or any(v in reject_sizes for v in values):
            return None
        if op_type == "Squeeze" and any(not _is_one(_meta_tensor(kw["input"]).shape[d]) for d in values):
            return None  # aten.squeeze ignores dims of size != 1, ONNX Squeeze fails on them
        return StandardCall(op_type, (kw["input"], _int64(values)))

    return rule


def _slice(kw: dict[str, Any], node: torch.fx.Node) -> StandardCall | None:
    start = 0 if kw["start"] is None else kw["start"]
    end = torch.iinfo(torch.int64).max if kw["end"] is None else kw["end"]
    bounds = _int_list([start, end, kw["step"]])
    if bounds is None:
        return None
    start, end, step = (_int64([v]) for v in bounds)
    return StandardCall("Slice", (kw["input"], start, end, _int64([kw["dim"]]), step))


def _reduce(op_type: str):
    def rule(kw: dict[str, Any], node: torch.fx.Node) -> StandardCall | None:
        axes = _int_list(kw["dim"])
        if not axes or kw.get("dtype") is not None:
            return None
        if _meta_tensor(kw["input"]).dtype != _meta_tensor(node).dtype:
            return None
        return StandardCall(op_type, (kw["input"], _int64(axes)), {"keepdims": int(kw["keepdim"])})

    return rule


def _split(kw: dict[str, Any], node: torch.fx.Node) -> StandardCall | None:
    sizes = _int_list(kw["split_sizes"])
    if sizes is None or _meta_tensor(kw["input"]) is None:
        return None
    return StandardCall("Split", (kw["input"], _int64(sizes)), {"axis": kw["dim"]}, num_outputs=len(sizes))


def _schema_accepts(call: StandardCall) -> bool:
    """Whether opset 18's schema of ``call.op_type`` accepts the input element types."""
    schema = onnx.defs.get_schema(call.op_type, STANDARD_OPSET, "")
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    bound: dict[str, str] = {}
    for position, value in enumerate(call.inputs):
        formal = schema.inputs[min(position, len(schema.inputs) - 1)]
        meta = value if isinstance(value, torch.Tensor) else _meta_tensor(value)
        if meta is None or meta.dtype not in TORCH_TO_ONNX_DTYPE:
            return False
        type_string = onnx_type_string(meta.dtype)
        if formal.type_str in allowed:
            if type_string not in allowed[formal.type_str]:
                return False
            if bound.setdefault(formal.type_str, type_string) != type_string:
                return False
        elif formal.type_str != type_string:
            return False
    return True


_aten = torch.ops.aten
_RULES: dict[Any, Callable[[dict[str, Any], torch.fx.Node], StandardCall | None]] = {
    **{op: _pointwise(name) for ops, name in [
        ((_aten.add.Tensor, _aten.add.Scalar), "Add"), ((_aten.sub.Tensor, _aten.sub.Scalar), "Sub"),
        ((_aten.mul.Tensor, _aten.mul.Scalar), "Mul"), ((_aten.div.Tensor, _aten.div.Scalar), "Div"),
        ((_aten.pow.Tensor_Tensor,), "Pow"), ((_aten.where.self,), "Where"),
        ((_aten.neg.default,), "Neg"), ((_aten.exp.default,), "Exp"), ((_aten.log.default,), "Log"),
        ((_aten.sqrt.default,), "Sqrt"), ((_aten.abs.default,), "Abs"),
        ((_aten.reciprocal.default,), "Reciprocal"), ((_aten.cos.default,), "Cos"),
        ((_aten.sin.default,), "Sin"), ((_aten.tanh.default,), "Tanh"),
        ((_aten.sigmoid.default,), "Sigmoid"), ((_aten.relu.default,), "Relu"),
        ((_aten.floor.default,), "Floor"), ((_aten.ceil.default,), "Ceil"), ((_aten.erf.default,), "Erf"),
    ] for op in ops},
    **{op: _pointwise(name, bool_result=True) for ops, name in [
        ((_aten.eq.Tensor, _aten.eq.Scalar), "Equal"), ((_aten.lt.Tensor, _aten.lt.Scalar), "Less"),
        ((_aten.le.Tensor, _aten.le.Scalar), "LessOrEqual"), ((_aten.gt.Tensor, _aten.gt.Scalar), "Greater"),
        ((_aten.ge.Tensor, _aten.ge.Scalar), "GreaterOrEqual"), ((_aten.logical_not.default,), "Not"),
        ((_aten.logical_and.default,), "And"), ((_aten.logical_or.default,), "Or"),
        ((_aten.logical_xor.default,), "Xor"),
    ] for op in ops},
    **{op: _pointwise(name, bitwise_op_type=bitwise) for ops, name, bitwise in [
        ((_aten.bitwise_and.Tensor, _aten.__and__.Tensor), "And", "BitwiseAnd"),
        ((_aten.bitwise_or.Tensor, _aten.__or__.Tensor), "Or", "BitwiseOr"),
        ((_aten.bitwise_xor.Tensor, _aten.__xor__.Tensor), "Xor", "BitwiseXor"),
        ((_aten.bitwise_not.default,), "Not", "BitwiseNot"),
    ] for op in ops},
    _aten.pow.Tensor_Scalar: _pow_scalar,
    _aten.clone.default: _same_dtype("Identity", ("input",)),  # ONNX values are never aliased
    _aten.alias.default: _same_dtype("Identity", ("input",)),
    _aten._to_copy.default: _to_copy,
    _aten.permute.default: _transpose,
    _aten.transpose.int: _transpose,
    _aten.cat.default: _concat,
    _aten.index_select.default: _gather,
    _aten.select.int: _gather,
    _aten.embedding.default: _gather,
    _aten.mm.default: _same_dtype("MatMul", ("input", "mat2")),
    _aten.bmm.default: _same_dtype("MatMul", ("input", "mat2")),
    _aten.matmul.default: _same_dtype("MatMul", ("input", "other")),
    _aten._softmax.default: _softmax("Softmax"),
    _aten.softmax.int: _softmax("Softmax"),
    _aten._log_softmax.default: _softmax("LogSoftmax"),
    _aten.unsqueeze.default: _with_int64_operand("Unsqueeze", "dim"),
    _aten.squeeze.dim: _with_int64_operand("Squeeze", "dim"),
    _aten.squeeze.dims: _with_int64_operand("Squeeze", "dim"),
    # ONNX Reshape reads 0 as "copy this dim" and Expand reads -1 as a size; ATen does not.
    _aten.view.default: _with_int64_operand("Reshape", "size", reject_sizes=(0,)),
    _aten._unsafe_view.default: _with_int64_operand("Reshape", "size", reject_sizes=(0,)),
    _aten.reshape.default: _with_int64_operand("Reshape", "shape", reject_sizes=(0,)),
    _aten.expand.default: _with_int64_operand("Expand", "size", reject_sizes=(-1,)),
    _aten.slice.Tensor: _slice,
    _aten.mean.dim: _reduce("ReduceMean"),
    _aten.sum.dim_IntList: _reduce("ReduceSum"),
    _aten.amax.default: _reduce("ReduceMax"),
    _aten.amin.default: _reduce("ReduceMin"),
    _aten.split_with_sizes.default: _split,
}
