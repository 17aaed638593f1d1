"""The two forms of attention a traced HF model holds, recognized for match_attention.

- SDPA: one ``aten.scaled_dot_product_attention(q, k, v, mask, scale=...)``.
- Eager (transformers' eager_attention_forward, traced where SDPA would drop a score soft-cap):
  ``p = softmax(cap * tanh(matmul(q, k.transpose(2, 3)) * scale / cap) + mask, -1, float32)``
  (the cap part only with a soft-cap), p cast back to q's dtype and passed through dropout
  (a clone in eval mode), then ``matmul(p, v)``.

Either way the site's k and v are the GQA-repeated [1, Hq, T, D] tensors and its output is
[1, Hq, T, D]; the mask (causal, sliding) is left for dead-code elimination, since its meaning
is carried by paged_attention's definition and the per-layer windows of the config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from octavo.errors import PassError
from octavo.ir.graph import find_nodes
from octavo.passes.pattern_utils import is_call, is_float_cast, only_user, tensor_value

aten = torch.ops.aten
_SOFTMAX = (aten.softmax.int, aten._softmax.default)


@dataclass
class AttentionSite:
    """One attention of the traced graph: inputs (k, v still repeated), its scale, soft-cap (0: none), output."""

    query: Node
    key: Node
    value: Node
    scale: float | None
    soft_cap: float
    output: Node


def find_attention_sites(graph_module: GraphModule) -> list[AttentionSite]:
    """Every SDPA and every eager attention of the graph, in graph order."""
    sites = [_sdpa_site(node) for node in find_nodes(graph_module, aten.scaled_dot_product_attention.default)]
    for softmax in [node for target in _SOFTMAX for node in find_nodes(graph_module, target)]:
        site = match_eager_attention(softmax)
        if site is not None:
            sites.append(site)
    order = {node: index for index, node in enumerate(graph_module.graph.nodes)}
    return sorted(sites, key=lambda site: order[site.output])


def _sdpa_site(sdpa: Node) -> AttentionSite:
    if sdpa.kwargs.get("dropout_p", 0.0) or (len(sdpa.args) > 4 and sdpa.args[4]):
        raise PassError(f"attention {sdpa.name} uses dropout; trace the model in eval mode")
    query, key, value = sdpa.args[:3]
    return AttentionSite(query, key, value, sdpa.kwargs.get("scale"), 0.0, sdpa)


def match_eager_attention(softmax: Node) -> AttentionSite | None:
    """The eager attention whose softmax is `softmax` (see the module docstring), or None."""
    if len(softmax.args) < 2 or softmax.args[1] not in (-1, 3):
        return None
    scores = _strip_mask(softmax.args[0])
    scores, soft_cap = _strip_soft_cap(scores)
    if not (is_call(scores, aten.mul.Tensor) and isinstance(scores.args[1], float)):
        return None
    product, scale = scores.args
    if not is_call(product, aten.matmul.default):
        return None
    query, transposed = product.args
    if not is_call(transposed, aten.transpose.int) or sorted(transposed.args[1:]) != [2, 3]:
        return None
    output = _weighted_values(softmax)
    if output is None:
        return None
    return AttentionSite(query, transposed.args[0], output.args[1], scale, soft_cap, output)


def _strip_mask(node: Node) -> Node:
    """The scores under `scores + mask` (the mask is the operand that is not a scaled or capped product)."""
    if not is_call(node, aten.add.Tensor) or len(node.args) != 2:
        return node
    for scores in node.args:
        if is_call(scores, aten.mul.Tensor):
            return scores
    return node


def _strip_soft_cap(node: Node) -> tuple[Node, float]:
    """(x, cap) when `node` is `tanh(x / cap) * cap`, else (node, 0.0)."""
    if not (is_call(node, aten.mul.Tensor) and isinstance(node.args[1], float)):
        return node, 0.0
    tanh = node.args[0]
    if not is_call(tanh, aten.tanh.default):
        return node, 0.0
    divided = tanh.args[0]
    if not (is_call(divided, aten.div.Tensor) and divided.args[1] == node.args[1]):
        return node, 0.0
    return divided.args[0], float(node.args[1])


def _weighted_values(softmax: Node) -> Node | None:
    """The `matmul(p, v)` that reads the softmax through its cast back and eval-mode dropout (a clone)."""
    node = softmax
    while True:
        user = only_user(node)
        if user is None:
            return None
        if is_float_cast(user) or is_call(user, aten.clone.default, aten.dropout.default):
            node = user
            continue
        if is_call(user, aten.matmul.default) and user.args[0] is node and tensor_value(user) is not None:
            return user
        return None
