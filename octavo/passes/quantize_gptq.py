"""The w4-gptq scheme: every linear's w4 groups rounded by GPTQ on its calibration Hessian.

Sequential, as in the GPTQ paper: the compiler's calibration run (frontend.calibration in
sequential mode) calls ``replace_calibrated_weight`` for each traced linear weight as soon as
the statistics of its input are complete, and the model run continues with the GPTQ solution
(dequantized) in its place. Each linear's Hessian ``H = 2 X^T X / n`` therefore comes from the
inputs it sees in the model whose earlier linears are already quantized (q, k, v before
o_proj, gate and up before down, every earlier layer), so each solve also absorbs the error
the earlier ones left. ``quantize_linear`` then stores those solutions (a fused qkv or gate_up
weight: its parts' solutions, row-concatenated, when it is exactly their concatenation; else
it solves the fused weight on its input's sequential statistics). Solver settings:
gptq_solver.gptq_quantize with 1% damping, blocks of 128 columns, act-order when
``--gptq-act-order``: the packed w4 layout every w4 artifact has, origin "gptq". A linear
without statistics gets RTN. The embedding and lm_head follow --vocab-quant (RTN), like w4.

Follows the GPTQ paper in: the layer-by-layer (here linear-by-linear) sequential statistics,
the Hessian of the layer-wise squared error over every calibration token, damping by a
fraction of its mean diagonal, the upper Cholesky factor of its inverse, column-by-column
rounding with error feedback and lazy batch updates, group scales fixed when their first
column is reached, optional act-order (with groups fixed up front, see gptq_solver). Beyond the
paper: each group's range is searched (each end of min/max cut on its own where that lowers the
H-weighted rounding error; the reference implementation's optional MSE grid shrinks the range
about its middle with plain error, which measured 3 points of perplexity worse on SmolLM2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.fx import GraphModule
from tqdm.auto import tqdm

from octavo.ir.linear_input_stats import LinearInputStats
from octavo.ir.quantized_layout import QuantizedWeight, concat_rows
from octavo.passes.gptq_solver import DEFAULT_DAMPING, GPTQ_RANGE_ERROR, gptq_quantize
from octavo.passes.quant_schemes import Calibration, QuantScheme, weight_input_stats
from octavo.passes.quantize_rtn import quantize_w4, range_cuts_record

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

    def sequential_key(self) -> tuple:
        return ("gptq", self.group_size, self.act_order)

    def replace_calibrated_weight(self, name: str, weight: Tensor, stats: LinearInputStats,
                                  calibration: Calibration) -> Tensor:
        """GPTQ of traced weight `name` on its (sequential) input statistics, kept in ``calibration.solved``."""
        if not stats.rows:
            return weight
        quantized, report = gptq_quantize(weight, stats.hessian(), self.group_size, act_order=self.act_order)
        calibration.solved[name] = (weight, quantized, report)
        return quantized.dequantize().to(weight.dtype)

    def quantize_linear(self, name: str, weight: Tensor, ctx) -> QuantizedWeight:
        stats = weight_input_stats(name, ctx)
        if stats is None or not stats.rows:
            self.record["rtn_without_statistics"] += 1
            return quantize_w4(weight, self.group_size)
        solved = _solved_parts(name, weight, ctx)
        if solved is not None:
            quantized, reports = solved
        else:
            quantized, report = gptq_quantize(weight, stats.hessian(), self.group_size, act_order=self.act_order)
            reports = [report]
        self.record["solved"] += 1
        if self.progress is not None:
            self.progress.update()
        self.record["max_damping"] = max(self.record["max_damping"], *(report["damping"] for report in reports))
        self.record["dead_columns"] += max(report["dead_columns"] for report in reports)
        return quantized

    def describe(self) -> dict:
        if self.progress is not None:
            self.progress.close()
        return {**super().describe(), "gptq": {"act_order": self.act_order, "damping": DEFAULT_DAMPING,
                                                "range_search": range_cuts_record(GPTQ_RANGE_ERROR), **self.record}}


def _solved_parts(name: str, weight: Tensor, ctx) -> tuple[QuantizedWeight, list[dict]] | None:
    """The sequential calibration's solutions of `name`'s parts, row-concatenated, if `weight` is exactly the
    concatenation of the weights they were solved for (no pass changed it since); else None."""
    parts = ctx.merged_weights.get(name, [name])
    solved = [ctx.calibration.solved.get(part) for part in parts]
    if any(entry is None for entry in solved):
        return None
    if not torch.equal(torch.cat([original for original, _, _ in solved]), weight):
        return None
    try:
        quantized = concat_rows([value for _, value, _ in solved])
    except ValueError:  # parts whose scales needed different dtypes
        return None
    quantized.origin = "gptq"
    return quantized, [report for _, _, report in solved]
