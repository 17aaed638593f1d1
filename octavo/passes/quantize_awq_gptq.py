"""The w4-awq-gptq scheme: AWQ's scales folded upstream, then GPTQ rounds the scaled weights.

A known combination of the two papers (AWQ's authors list it as compatible with GPTQ; several
quantization toolkits run it): ``prepare`` is w4-awq's (the same fold sites, the same
``s = mean|x| ** alpha`` search, the same folds, see quantize_awq), so the graph computes the
float function with weights ``W diag(s)`` reading inputs ``x / s``. ``quantize_linear`` then
solves each scaled weight by GPTQ (gptq_solver.gptq_quantize, 1% damping, act-order when
``--gptq-act-order``) on the Hessian of its scaled input,
``H_s = diag(1/s) H diag(1/s)`` with ``H = 2 X^T X / n`` of the unscaled input: exactly the
Hessian of the inputs the folded linear reads, so GPTQ minimizes that linear's output error as
it does for w4-gptq. Values' origin in the manifest: "awq-gptq".

Differs from w4-gptq in where the statistics come from: every linear's Hessian is the float
model's (the one AWQ's search used), not the sequential one of a model whose earlier linears
are already quantized; AWQ's clipping search is not run (clipping the weights before GPTQ
measured worse); GPTQ searches each group's range itself (gptq_solver, step 5) among ranges
shrunk about their middle (quantize_rtn.SYMMETRIC_RANGE_CUTS: both ends cut alike by 0, 0.025,
..., 0.125 of the width), not w4-gptq's ends cut on their own: on SmolLM2 at group 64 this
scheme's perplexity is 15.09 that way against 15.29 with w4-gptq's cuts, while w4-gptq
(act-order) scores 14.87 with its cuts against 15.53 with these. A linear
without statistics, or one whose fold site was left alone, is solved on its unscaled Hessian
(none at all: RTN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.fx import GraphModule
from tqdm.auto import tqdm

from octavo.ir.quantized_layout import QuantizedWeight
from octavo.passes.gptq_solver import DEFAULT_DAMPING, GPTQ_RANGE_ERROR, gptq_quantize
from octavo.passes.quant_schemes import weight_input_stats
from octavo.passes.quantize_awq import AWQScheme
from octavo.passes.quantize_rtn import SYMMETRIC_RANGE_CUTS, quantize_w4, range_cuts_record


@dataclass
class AWQGPTQScheme(AWQScheme):
    """See the module docstring."""

    act_order: bool = False
    progress: object = None

    def prepare(self, graph_module: GraphModule, ctx) -> None:
        """AWQ's folds, then a progress bar over the linears that have statistics (the GPTQ solves)."""
        super().prepare(graph_module, ctx)
        linears = graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
        total = sum(weight_input_stats(node.args[1].name, ctx) is not None for node in linears)
        self.progress = tqdm(total=total, desc="gptq", unit="linear", disable=not ctx.config.progress)

    def quantize_linear(self, name: str, weight: Tensor, ctx) -> QuantizedWeight:
        stats = weight_input_stats(name, ctx)
        if stats is None or not stats.rows:
            return quantize_w4(weight, self.group_size)
        hessian = stats.hessian()
        if name in self.input_scales:
            inverse = 1.0 / self.input_scales[name]
            hessian = hessian * inverse.unsqueeze(0) * inverse.unsqueeze(1)
        quantized, _ = gptq_quantize(weight, hessian, self.group_size, act_order=self.act_order,
                                     range_cuts=SYMMETRIC_RANGE_CUTS)
        quantized.origin = "awq-gptq"
        if self.progress is not None:
            self.progress.update()
        return quantized

    def rounding_record(self) -> dict:
        """None of AWQ's range search: GPTQ chooses the ranges (recorded under "gptq")."""
        return {}

    def describe(self) -> dict:
        if self.progress is not None:
            self.progress.close()
        return {**super().describe(), "gptq": {"act_order": self.act_order, "damping": DEFAULT_DAMPING,
                                                "range_search": range_cuts_record(GPTQ_RANGE_ERROR,
                                                                                  SYMMETRIC_RANGE_CUTS),
                                                "hessian": "float model, scaled by AWQ's 1/s"}}
