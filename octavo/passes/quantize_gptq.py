"""The w4-gptq scheme: every linear's w4 groups rounded by GPTQ on its calibration Hessian.

``quantize_linear`` takes the statistics of the linear's input that the compiler collected on
the calibration text (``ctx.calibration.linear_inputs``, float model; a fused qkv or gate_up
weight shares its parts' input), forms ``H = 2 X^T X / n`` and solves with
gptq_solver.gptq_quantize (1% damping, blocks of 128 columns, act-order when
``--gptq-act-order``): the packed w4 layout every w4 artifact has, origin "gptq". A linear
without statistics gets RTN. The embedding and lm_head follow --vocab-quant (RTN), like w4.

Follows the GPTQ paper in: the Hessian of the layer-wise squared error, damping by a fraction
of its mean diagonal, the upper Cholesky factor of its inverse, column-by-column rounding
with error feedback and lazy batch updates, group scales fixed when their first column is
reached, optional act-order (with groups fixed up front, see gptq_solver). Simplified: every
Hessian comes from one run of the float model (the paper runs layer after layer on the
outputs of the already quantized layers before it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.fx import GraphModule
from tqdm.auto import tqdm

from octavo.ir.quantized_layout import QuantizedWeight
from octavo.passes.gptq_solver import DEFAULT_DAMPING, gptq_quantize
from octavo.passes.quant_schemes import QuantScheme, weight_input_stats
from octavo.passes.quantize_rtn import quantize_w4

aten = torch.ops.aten


@dataclass
class GPTQScheme(QuantScheme):
    """See the module docstring; ``record`` sums the solver's reports for the manifest."""

    act_order: bool = False
    record: dict = field(default_factory=lambda: {"solved": 0, "rtn_without_statistics": 0, "max_damping": 0.0,
                                                  "dead_columns": 0})
    progress: object = None

    def prepare(self, graph_module: GraphModule, ctx) -> None:
        """Only opens the progress bar over the linears that have statistics."""
        names = [node.args[1].name for node in graph_module.graph.find_nodes(op="call_function",
                                                                              target=aten.linear.default)]
        total = sum(weight_input_stats(name, ctx) is not None for name in names)
        self.progress = tqdm(total=total, desc="gptq", unit="linear", disable=not ctx.config.progress)

    def quantize_linear(self, name: str, weight: Tensor, ctx) -> QuantizedWeight:
        stats = weight_input_stats(name, ctx)
        if stats is None or not stats.rows:
            self.record["rtn_without_statistics"] += 1
            return quantize_w4(weight, self.group_size)
        quantized, report = gptq_quantize(weight, stats.hessian(), self.group_size, act_order=self.act_order)
        self.record["solved"] += 1
        if self.progress is not None:
            self.progress.update()
        self.record["max_damping"] = max(self.record["max_damping"], report["damping"])
        self.record["dead_columns"] += report["dead_columns"]
        return quantized

    def describe(self) -> dict:
        if self.progress is not None:
            self.progress.close()
        return {**super().describe(), "gptq": {"act_order": self.act_order, "damping": DEFAULT_DAMPING, **self.record}}
