"""The w4-awq scheme: activation-aware per-input-channel scales folded upstream, clipping, then RTN w4 groups.

``prepare`` (before any weight is quantized, on the fused graph) finds every fold site:

- norm sites: a linear (the fused qkv, the fused gate_up) whose input is the output of
  ``octavo.rms_norm(x, w, eps)`` or ``fused_add_rms_norm``'s normed output, read by nothing
  but weight linears: ``w[j] /= s[j]`` on the norm weight, ``W[:, j] *= s[j]`` on every
  linear reading it;
- down sites: a linear reading ``octavo.silu_and_mul(u)`` where u is a weight linear (the
  fused gate_up, rows [gate; up]): ``W_up[j, :] /= s[j]`` (and its bias) and
  ``W_down[:, j] *= s[j]``, since ``silu(g) * (u / s) = (silu(g) * u) / s``.

For each site the scales come from awq_search.search_scales on the statistics of the
linears' input that the compiler collected on the calibration text
(``ctx.calibration.linear_inputs``, float model). Every fold is an identity in exact
arithmetic: the folded graph computes the float function up to float32 rounding of the
multiplied and divided weights. A site is left alone when a linear of it has no statistics
or keeps a value supplied already quantized (a GGUF Q4 tensor at the scheme's group size,
which quantize_weights stores as it is).

``quantize_linear`` then chooses each (scaled) weight's range per row and group by
awq_search.search_range, on the input's Gram matrix divided by ``s s^T`` (the input after the
fold), refits each group's 16 levels from that range (awq_search.refine_group_params: the scale
and offset of least output error for the group's codes, kept only where they lower it) and rounds
every value to the nearest level (quantize_rtn.quantize_w4_on_params): the packed layout every w4
artifact has. The values' origin in the manifest is "awq".

Follows the AWQ paper and its reference code in: the ``s = mean|x| ** alpha`` grid of 20
alphas, normalized scales, folding into the preceding op, the per-group clipping search of
``max|w|``, searched here as each end of the asymmetric range on its own (the w4 layout has an
offset per group). Added (not in the paper): the level refit after the range search. Simplified: the
statistics come from one run of the float model (the reference
re-runs each block on the outputs of the already scaled blocks before it); the loss is each
fused linear's own output error (the reference measures the whole attention or MLP block's
output); o_proj is not folded into v (the reference folds it only when the shapes match,
which GQA models such as SmolLM2 do not); ranges are searched for q and k too. Not taken:
AutoAWQ's "duo" scales (``mean|x| ** alpha / mean|w| ** (1 - alpha)``, w the group-normalized
weight magnitudes) and scoring each alpha with the range search applied: on SmolLM2 at group 64
each scored a worse perplexity than this search, duo even when added beside these candidates
(which can only lower the least loss): the loss is a proxy, and a closer fit of it did not help.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.fx import GraphModule, Node
from tqdm.auto import tqdm

from octavo.ir.quantized_layout import W4, QuantizedWeight
from octavo.passes.awq_search import (
    REFIT_ROUNDS,
    gram_blocks,
    refine_group_params,
    search_range,
    search_scales,
)
from octavo.passes.pattern_utils import is_call
from octavo.passes.quant_schemes import QuantScheme, weight_input_stats
from octavo.passes.quantize_rtn import quantize_w4, quantize_w4_on_params, range_cuts_record
from octavo.passes.quantize_weights import keeps_supplied, provided_value

logger = logging.getLogger(__name__)

aten = torch.ops.aten
octavo = torch.ops.octavo


@dataclass
class FoldSite:
    """Linears that read one input, and where that input's channels can be divided by scales.

    ``kind`` is "norm" (``source`` is the norm's weight placeholder) or "down" (``source``
    is the gate_up linear's weight placeholder, whose second half of rows is up).
    """

    kind: str
    source: Node
    linears: list[Node]


@dataclass
class AWQScheme(QuantScheme):
    """See the module docstring; ``input_scales`` holds the scales folded into each weight's input."""

    input_scales: dict[str, Tensor] = field(default_factory=dict)
    record: dict = field(default_factory=dict)

    def prepare(self, graph_module: GraphModule, ctx) -> None:
        sites = fold_sites(graph_module, ctx)
        folded = skipped = 0
        alphas = []
        for site in tqdm(sites, desc="awq scales", unit="site", disable=not ctx.config.progress):
            names = [linear.args[1].name for linear in site.linears]
            stats = [weight_input_stats(name, ctx) for name in names]
            touched = [*names, *([site.source.name] if site.kind == "down" else [])]
            if any(value is None for value in stats) or any(
                    keeps_supplied(provided_value(name, ctx), W4, False, ctx.config) for name in touched):
                skipped += 1
                continue
            gram = stats[0].gram / max(stats[0].rows, 1)
            weights = [ctx.weights[name] for name in names]
            scales, alpha, _ = search_scales(weights, gram, stats[0].abs_mean, self.group_size)
            fold(site, scales, ctx)
            for name in names:
                self.input_scales[name] = scales
            folded += 1
            alphas.append(alpha)
        self.record = {"fold_sites": len(sites), "folded": folded, "left_unscaled": skipped,
                       "mean_alpha": round(sum(alphas) / len(alphas), 3) if alphas else None}
        logger.info("AWQ: %s", self.record)

    def quantize_linear(self, name: str, weight: Tensor, ctx) -> QuantizedWeight:
        stats = weight_input_stats(name, ctx)
        if stats is None or not stats.rows:
            return quantize_w4(weight, self.group_size)
        gram = stats.gram / stats.rows
        if name in self.input_scales:
            inverse = 1.0 / self.input_scales[name]
            gram = gram * inverse.unsqueeze(0) * inverse.unsqueeze(1)
        blocks = gram_blocks(gram, self.group_size)
        low, high = search_range(weight, blocks, self.group_size)
        scales, offsets = refine_group_params(weight, blocks, self.group_size, low, high)
        quantized = quantize_w4_on_params(weight, self.group_size, scales, offsets)
        quantized.origin = "awq"
        return quantized

    def describe(self) -> dict:
        return {**super().describe(), "awq": {**self.record, **self.rounding_record()}}

    def rounding_record(self) -> dict:
        """How quantize_linear picks each group's range, for the manifest."""
        return {"range_search": range_cuts_record("d^T G_g d, G_g the group's block of the input's X^T X"),
                "level_refit": {"rounds": REFIT_ROUNDS, "least": "d^T G_g d",
                                "kept": "per group, where below the range search's error"}}


def fold_sites(graph_module: GraphModule, ctx) -> list[FoldSite]:
    """The norm and down sites of the graph (see the module docstring), in graph order."""
    linears = graph_module.graph.find_nodes(op="call_function", target=aten.linear.default)
    lm_head = linears[-1] if linears else None
    sites = []
    for node in graph_module.graph.nodes:
        readers = [user for user in node.users if _weight_linear(user, ctx) and user.args[0] is node]
        if not readers or len(readers) != len(node.users) or lm_head in readers:
            continue
        norm_weight = _norm_weight(node, ctx)
        if norm_weight is not None and len(norm_weight.users) == 1:
            sites.append(FoldSite("norm", norm_weight, readers))
        elif is_call(node, octavo.silu_and_mul.default) and _weight_linear(node.args[0], ctx) \
                and len(node.args[0].users) == 1 and len(node.args[0].args[1].users) == 1:
            sites.append(FoldSite("down", node.args[0].args[1], readers))
    return sites


def fold(site: FoldSite, scales: Tensor, ctx) -> None:
    """Divide the site's input channels by `scales` upstream and multiply the linears' columns (new tensors)."""
    for linear in site.linears:
        name = linear.args[1].name
        ctx.weights[name] = (ctx.weights[name].float() * scales).to(ctx.weights[name].dtype)
    source = ctx.weights[site.source.name]
    if site.kind == "norm":
        ctx.weights[site.source.name] = (source.float() / scales).to(source.dtype)
        return
    half = source.shape[0] // 2
    row_scales = torch.cat([torch.ones(half), scales])
    ctx.weights[site.source.name] = (source.float() / row_scales.unsqueeze(1)).to(source.dtype)
    gate_up = next(user for user in site.source.users)
    bias = gate_up.args[2] if len(gate_up.args) == 3 else None
    if bias is not None:
        ctx.weights[bias.name] = (ctx.weights[bias.name].float() / row_scales).to(ctx.weights[bias.name].dtype)


def _weight_linear(node, ctx) -> bool:
    """An aten.linear whose weight is a 2-D weight placeholder read by it alone, with even in_features."""
    if not is_call(node, aten.linear.default) or node.kwargs or len(node.args) not in (2, 3):
        return False
    weight = node.args[1]
    return (isinstance(weight, Node) and weight.op == "placeholder" and weight.name in ctx.weights
            and len(weight.users) == 1 and ctx.weights[weight.name].dim() == 2 and node.args[0] is not weight)


def _norm_weight(node: Node, ctx) -> Node | None:
    """The weight placeholder of the RMSNorm whose normed output `node` is, if it is one."""
    if is_call(node, octavo.rms_norm.default):
        weight = node.args[1]
    elif node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0 \
            and is_call(node.args[0], octavo.fused_add_rms_norm.default):
        weight = node.args[0].args[2]
    else:
        return None
    is_weight = isinstance(weight, Node) and weight.op == "placeholder" and weight.name in ctx.weights
    return weight if is_weight and ctx.weights[weight.name].dim() == 1 else None
