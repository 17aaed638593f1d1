"""quantize_weights: linears (and the embedding / lm_head) over float weights -> octavo quantized ops.

Runs with ``--quant w8|w8a8|w4|fp8|w4-awq|w4-gptq|w4-awq-gptq`` (see quant_schemes for what a scheme decides),
after fuse_qkv and fuse_gate_up, so a fused qkv or gate_up linear is quantized as one weight. w8a8 stores what w8
stores (its linears always one scale per output channel) and records in the manifest that the runtime rounds the
linears' inputs to int8 (``activations``); the graph is the same.

For every weight placeholder that only ``aten.linear`` (as its weight) and
``aten.embedding`` (as its table) read:

- the embedding table and the lm_head weight (one placeholder when tied) get the scheme's
  vocab layout (``--vocab-quant``: int8 with one scale per vocabulary row by default, see
  quant_schemes.VOCAB_REASONS for why; 4-bit groups; or float);
- every other linear weight gets the scheme's layout: ``linear_w8`` (int8, per output
  channel), ``linear_w4`` (4-bit asymmetric, group-wise) or ``linear_fp8`` (float8_e4m3fn,
  per output channel); w4 needs an even number of input features, else the linear stays
  float with that reason;
- values come from ``ctx.provided_weights`` when the weight (or, for a fused weight, every
  part of it, in order) was supplied already quantized in the same layout: they are stored
  unchanged, no float round trip (GGUF Q4_0/Q4_1 -> w4, Q8_0 -> w8, group size 32); otherwise
  from the scheme (RTN for w8/w4/fp8, see quantize_rtn), after ``scheme.prepare``.

Each quantized weight ``X_weight`` becomes placeholders ``X_qweight``, ``X_scales`` (and
``X_offsets`` for w4) in the layouts of octavo.ir.quantized_layout; the linear becomes
``octavo.linear_*(x, qweight, scales, [offsets,] bias, [group_size])`` (the bias stays
float) and the embedding ``octavo.embedding_w8/w4(..., indices, group_size, dtype)`` with
the table's float dtype. By the ops' definitions each node then computes the float op on
the dequantized weight. Norm weights, biases and the rotary table stay float (1-D vectors
or tables: a tiny share of the bytes). ``ctx.quantization`` records scheme, group size,
what stayed float and why, and the origin of the values, for the manifest.

Group size of w4: 32 by default, chosen by measurement on SmolLM2 (scripts/quant_compare.py,
8191 tokens of the evaluation text): its weights are GGUF Q4_1 blocks of 32, which group 32
keeps exactly (perplexity 14.39, equal to fp32's 14.39), while groups of 64 and 128 must
round them again (18.61 and 22.86: +29% and +59%) to save 0.5 and 0.75 bit per weight. 32
is also GGUF's own Q4 block, so imported and RTN artifacts share one kernel configuration.

The experts of mixture-of-experts nodes are quantized by quantize_experts (its docstring).

Stats: quantized_linears, quantized_vocab, provided (values stored as supplied), quantized_moe
(octavo.moe nodes whose experts were quantized, when there are some), left_float, bytes_before, bytes_after.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.quantized_layout import FP8, W4, W8, QuantizedWeight, concat_rows
from octavo.passes.context import PassContext
from octavo.passes.pattern_utils import is_call, is_weight
from octavo.passes.quant_schemes import QuantScheme, scheme_for
from octavo.passes.quantize_experts import quantize_experts
from octavo.passes.registry import register_pass

logger = logging.getLogger(__name__)

aten = torch.ops.aten
octavo = torch.ops.octavo

_LINEAR_OPS = {W8: octavo.linear_w8.default, W4: octavo.linear_w4.default, FP8: octavo.linear_fp8.default}
_EMBEDDING_OPS = {W8: octavo.embedding_w8.default, W4: octavo.embedding_w4.default}


@register_pass("quantize_weights", "store linear, embedding and lm_head weights quantized (--quant) and "
               "compute with octavo.linear_w8/w4/fp8 and embedding_w8/w4")
def quantize_weights(graph_module: GraphModule, ctx: PassContext) -> GraphModule:
    """See the module docstring."""
    scheme = scheme_for(ctx.config)
    if scheme is None:
        raise PassError("quantize_weights runs only with a quantization scheme (--quant)")
    scheme.prepare(graph_module, ctx)
    vocab_weights = _vocab_weights(graph_module, ctx)
    counts = Counter(quantized_linears=0, quantized_vocab=0, provided=0)
    origins: Counter = Counter()
    left_float: dict[str, list[str]] = {}
    vocab_record: dict = {}
    bytes_before = sum(t.numel() * t.element_size() for t in ctx.weights.values())
    for weight in _quantizable_weights(graph_module, ctx, left_float):
        is_vocab = weight in vocab_weights
        supplied = provided_value(weight.name, ctx)
        quantized, reason = _quantize(weight, is_vocab, supplied, scheme, ctx)
        if quantized is None:
            left_float.setdefault(reason, []).append(weight.name)
            continue
        if is_vocab:
            vocab_record.setdefault("weights", []).append(
                {"weight": weight.name, "layout": quantized.layout, "group_size": quantized.group_size,
                 "tied": _is_tied(weight), "origin": quantized.origin})
            vocab_record["reason"] = scheme.vocab_reason
        _rewrite_users(graph_module, ctx, weight, quantized)
        counts["quantized_vocab" if is_vocab else "quantized_linears"] += 1
        counts["provided"] += quantized is supplied
        origins[quantized.origin] += 1
    if not counts["quantized_linears"]:
        raise PassError(f"quantize_weights ({scheme.name}) found no linear it could quantize")
    moe_nodes = quantize_experts(graph_module, ctx, scheme, left_float)
    if moe_nodes:
        counts["quantized_moe"] = moe_nodes
    bytes_after = sum(t.numel() * t.element_size() for t in ctx.weights.values())
    ctx.quantization = {**(ctx.quantization or {}), **_record(scheme, ctx, origins, vocab_record, left_float,
                                                              bytes_before, bytes_after)}
    ctx.stats.update({**counts, "left_float": sum(map(len, left_float.values())), "bytes_before": bytes_before,
                      "bytes_after": bytes_after})
    return graph_module


def _quantizable_weights(graph_module: GraphModule, ctx: PassContext, left_float: dict) -> list[Node]:
    """Weight placeholders read only as a linear's weight or an embedding's table."""
    weights = []
    for node in graph_module.graph.find_nodes(op="placeholder"):
        if not is_weight(node, ctx) or not node.users:
            continue
        uses = [_use(user, node) for user in node.users]
        if not any(uses):
            continue
        tensor = ctx.weights[node.name]
        if not all(uses):
            left_float.setdefault("also read by ops other than linear/embedding", []).append(node.name)
        elif tensor.dim() != 2 or not tensor.dtype.is_floating_point:
            left_float.setdefault("not a 2-D float tensor", []).append(node.name)
        else:
            weights.append(node)
    return weights


def _use(user: Node, weight: Node) -> str | None:
    """"linear" / "embedding" when `user` reads `weight` as a linear weight / embedding table, else None."""
    if is_call(user, aten.linear.default) and not user.kwargs and len(user.args) in (2, 3) \
            and user.args[1] is weight and weight not in (user.args[0], *user.args[2:]):
        return "linear"
    if is_call(user, aten.embedding.default) and user.args[0] is weight and weight not in user.args[1:]:
        return "embedding"
    return None


def _vocab_weights(graph_module: GraphModule, ctx: PassContext) -> set[Node]:
    """The embedding tables and the lm_head weight (the last linear's, which produces the logits)."""
    vocab = {node.args[0] for node in graph_module.graph.find_nodes(op="call_function", target=aten.embedding.default)}
    linears = graph_module.graph.find_nodes(op="call_function", target=aten.linear.default)
    if linears:
        vocab.add(linears[-1].args[1])
    return {node for node in vocab if is_weight(node, ctx)}


def _is_tied(weight: Node) -> bool:
    return {_use(user, weight) for user in weight.users} == {"linear", "embedding"}


def _quantize(weight: Node, is_vocab: bool, provided: QuantizedWeight | None, scheme: QuantScheme,
              ctx: PassContext) -> tuple[QuantizedWeight | None, str]:
    """The quantized value of `weight` (`provided`, when it fits), or (None, why it stays float)."""
    layout = scheme.vocab_layout if is_vocab else scheme.layout
    if layout is None:
        return None, scheme.vocab_reason
    tensor = ctx.weights[weight.name]
    if layout == W4 and tensor.shape[1] % 2:
        return None, "w4 needs an even number of input features"
    # An explicit --group-size other than the supplied values' asks for new values.
    if keeps_supplied(provided, layout, is_vocab, ctx.config):
        return provided, ""
    if provided is not None:
        logger.info("%s: supplied as %s, which is not %s: quantized again from its float values",
                    weight.name, provided.origin, layout)
    if is_vocab:
        return scheme.quantize_vocab(weight.name, tensor, ctx), ""
    return scheme.quantize_linear(weight.name, tensor, ctx), ""


def keeps_supplied(provided: QuantizedWeight | None, layout: str, is_vocab: bool, config) -> bool:
    """Whether a supplied value is stored as it is: same layout, and no explicit other group size for a linear
    (w8a8's linears: one scale per output channel, so a grouped supplied value is quantized again)."""
    if provided is None or provided.layout != layout:
        return False
    if is_vocab:
        return True
    if config.quant == "w8a8":
        return provided.group_size >= provided.qweight.shape[1]
    return config.group_size in (None, provided.group_size)


def provided_value(name: str, ctx: PassContext) -> QuantizedWeight | None:
    """The supplied quantized value of weight `name`; for a fused weight the row concatenation of its parts'."""
    if name in ctx.provided_weights:
        return ctx.provided_weights[name]
    parts = ctx.merged_weights.get(name)
    if not parts:
        return None
    values = [provided_value(part, ctx) for part in parts]
    if any(value is None for value in values):
        return None
    try:
        return concat_rows(values)
    except ValueError:
        return None


def _rewrite_users(graph_module: GraphModule, ctx: PassContext, weight: Node, quantized: QuantizedWeight) -> None:
    """Add the quantized placeholders, point every user at its quantized op, drop the float weight."""
    base = weight.name.removesuffix("_weight")
    nodes = {role: ctx.add_weight(graph_module, f"{base}_{role}", tensor)
             for role, tensor in quantized.tensors().items()}
    dtype = ctx.weights[weight.name].dtype
    graph = graph_module.graph
    for user in list(weight.users):
        with graph.inserting_before(user):
            if _use(user, weight) == "linear":
                replacement = graph.call_function(_LINEAR_OPS[quantized.layout],
                                                  _linear_args(user, nodes, quantized))
            else:
                replacement = graph.call_function(_EMBEDDING_OPS[quantized.layout],
                                                  (*nodes.values(), user.args[1], quantized.group_size, dtype))
        replacement.meta = dict(user.meta)
        user.replace_all_uses_with(replacement)
        graph.erase_node(user)
    graph.erase_node(weight)
    del ctx.weights[weight.name]


def _linear_args(linear: Node, nodes: dict[str, Node], quantized: QuantizedWeight) -> tuple:
    bias = linear.args[2] if len(linear.args) == 3 else None
    if quantized.layout == FP8:
        return (linear.args[0], nodes["qweight"], nodes["scales"], bias)
    return (linear.args[0], *nodes.values(), bias, quantized.group_size)


def _record(scheme: QuantScheme, ctx: PassContext, origins: Counter, vocab: dict, left_float: dict,
            bytes_before: int, bytes_after: int) -> dict:
    left = [{"weights": names, "reason": reason} for reason, names in left_float.items()]
    left.append({"weights": "norm weights, biases, rotary table",
                 "reason": "vectors and small tables, a tiny share of the bytes: kept exact in float"})
    return {
        **scheme.describe(),
        "values": dict(sorted(origins.items())),
        "vocab": vocab or None,
        "left_unquantized": left,
        "calibration": getattr(ctx.calibration, "description", None) if scheme.calibrated else None,
        "weight_bytes_before": bytes_before,
        "weight_bytes_after": bytes_after,
    }
