"""The weights of the linears and embeddings shard_tensor_parallel splits, float and quantized, and their slices.

Every linear op the sharding knows reads its weight tensors at fixed
argument positions (``WEIGHT_ARGS``): one float weight for ``aten.linear`` and
``octavo.linear_w16``; ``qweight``, ``scales`` (and ``offsets`` for w4) for
the quantized ops, whose layouts are in octavo.ir.quantized_layout.

- By output rows (column parallel, and the vocabulary rows of the embedding
  and lm_head): every weight tensor and the bias keep the same rows; a
  quantized row carries its own scales, so the slice is exact.
- By input columns (row parallel: o_proj, down_proj): the float weight keeps
  the columns; a quantized weight keeps its qweight columns (bytes ``k // 2``
  for w4) and the scale (and offset) columns of the groups those cover. A
  group never straddles two ranks: a rank's columns must start and end on
  group boundaries (or at the end of the row), else PassError names the
  sizes. A weight of one group per row (per-output-channel scales) keeps its
  scales whole and its group size becomes the rank's column count; fp8's
  scales are per row and are kept whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from octavo.errors import PassError
from octavo.ir.ops import linear as _linear  # noqa: F401  (registers octavo::linear_w16)
from octavo.ir.ops import quantized_linear as _quantized  # noqa: F401  (registers the quantized ops)

aten = torch.ops.aten
octavo = torch.ops.octavo


@dataclass(frozen=True)
class WeightArgs:
    """Argument positions of one op's weight tensors, bias and group size (None: the op has none)."""

    layout: str  # "float", "w8", "w4" or "fp8"
    tensors: tuple[int, ...]
    bias: int | None
    group_size: int | None
    indices: int | None = None  # embeddings: the token ids


LINEAR_ARGS = {
    aten.linear.default: WeightArgs("float", (1,), 2, None),
    octavo.linear_w16.default: WeightArgs("float", (1,), 2, None),
    octavo.linear_w8.default: WeightArgs("w8", (1, 2), 3, 4),
    octavo.linear_w4.default: WeightArgs("w4", (1, 2, 3), 4, 5),
    octavo.linear_fp8.default: WeightArgs("fp8", (1, 2), 3, None),
}
EMBEDDING_ARGS = {
    aten.embedding.default: WeightArgs("float", (0,), None, None, indices=1),
    octavo.embedding_w8.default: WeightArgs("w8", (0, 1), None, 3, indices=2),
    octavo.embedding_w4.default: WeightArgs("w4", (0, 1, 2), None, 4, indices=3),
}
LINEARS = tuple(LINEAR_ARGS)
EMBEDDINGS = tuple(EMBEDDING_ARGS)


def args_of(node: Node) -> WeightArgs:
    return {**LINEAR_ARGS, **EMBEDDING_ARGS}[node.target]


def weight_tensor_nodes(node: Node) -> list[Node]:
    """The weight tensors of a linear or embedding node, in argument order (qweight first)."""
    return [node.args[index] for index in args_of(node).tensors]


def bias_of(node: Node) -> Node | None:
    index = args_of(node).bias
    return node.args[index] if index is not None and len(node.args) > index else None


def in_features(node: Node, weights: dict[str, torch.Tensor]) -> int:
    """K, the input features of a linear (two per byte of a w4 qweight)."""
    columns = int(weights[node.args[1].name].shape[1])
    return 2 * columns if args_of(node).layout == "w4" else columns


@dataclass(frozen=True)
class ColumnSlices:
    """A row-parallel rank's share of a linear's weights: the column range of each weight tensor (None: keep the
    tensor whole) and the group size its op is called with afterwards."""

    ranges: list[range | None]
    group_size: int | None


def column_slices(node: Node, weights: dict[str, torch.Tensor], columns: range) -> ColumnSlices:
    """Input columns `columns` of the linear `node` (see the module docstring)."""
    spec = args_of(node)
    if spec.layout == "float":
        return ColumnSlices([columns], None)
    if spec.layout == "fp8":
        return ColumnSlices([columns, None], None)
    total = in_features(node, weights)
    group_size = int(node.args[spec.group_size])
    if spec.layout == "w4" and (columns.start % 2 or columns.stop % 2):
        raise PassError(f"shard_tensor_parallel: {node.name}'s rank columns [{columns.start}, {columns.stop}) split "
                        "a byte of its 4-bit weight (two columns per byte)")
    qweight_columns = range(columns.start // 2, columns.stop // 2) if spec.layout == "w4" else columns
    if group_size >= total:  # one group per row: per-output-channel scales, the same for every column
        return ColumnSlices([qweight_columns, *[None] * (len(spec.tensors) - 1)], len(columns))
    if columns.start % group_size or (columns.stop % group_size and columns.stop != total):
        raise PassError(f"shard_tensor_parallel: {node.name}'s rank columns [{columns.start}, {columns.stop}) of "
                        f"{total} cut a quantization group of {group_size} columns; a group cannot straddle two "
                        "ranks (choose a tensor parallel size whose share of the input features is a multiple of "
                        "the group size)")
    groups = range(columns.start // group_size, -(-columns.stop // group_size))
    return ColumnSlices([qweight_columns, *[groups] * (len(spec.tensors) - 1)], group_size)
