"""PassContext: what every pass receives besides the graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dynamo.source import ConstantSource
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import DimDynamic

from octavo.config import CompileConfig, RankPosition
from octavo.ir.quantized_layout import QuantizedWeight

# Example sizes that back newly created symbols during fake propagation.
_SYMBOL_HINTS = {"B": 3, "N": 3, "max_blocks": 5, "num_blocks": 17}


@dataclass
class PassContext:
    """Compile config, weights (passes may transform them), model config and per-pass stats.

    `architecture` is the model's Architecture (octavo.frontend.architectures):
    passes read its traits through this object (``model_type``,
    ``sliding_windows(model_config)``) and never import the frontend.

    `symbols` maps readable names ("T", "B", "max_blocks", "num_blocks", "N")
    to the SymInts of the fake mode that annotates the graph, so a pass can
    add runtime inputs with symbolic shapes. `stats` is the dict the current
    pass fills; the manager moves it into `history` after the pass.
    `rank` is set when passes prepare one rank's program of a parallel layout
    (shard_tensor_parallel, split_pipeline_stages); `pipeline_stage` is what
    split_pipeline_stages records about the stage it kept.

    Quantization: `provided_weights` holds already quantized values of weights
    (by placeholder name; GGUF import fills it) that quantize_weights stores
    as they are; `merged_weights` records which weights a fused weight
    concatenates (row order); `calibration` is the calibration token ids
    (a list of lists) for calibrated schemes; `quantization` is the record
    the quantize_* passes write for the manifest.
    """

    config: CompileConfig
    weights: dict[str, torch.Tensor]
    model_config: Any
    architecture: Any
    fake_mode: Any
    symbols: dict[str, torch.SymInt]
    stats: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    kv_layout: dict | None = None
    runtime_inputs: dict[str, dict] = field(default_factory=dict)
    propagation_timings: dict[str, float] = field(default_factory=dict)
    rank: RankPosition | None = None
    pipeline_stage: dict | None = None
    provided_weights: dict[str, QuantizedWeight] = field(default_factory=dict)
    merged_weights: dict[str, list[str]] = field(default_factory=dict)
    calibration: Any = None
    quantization: dict | None = None
    lora: dict | None = None  # insert_lora's layout of the LoRA factor inputs, for the manifest

    def symbol(self, name: str) -> torch.SymInt:
        """The SymInt called `name`, created (as a fresh dynamic symbol) on first use."""
        if name not in self.symbols:
            shape_env = self.fake_mode.shape_env
            source = ConstantSource(name)
            hint = _SYMBOL_HINTS.get(name, 7)
            symbol = shape_env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC)
            self.symbols[name] = shape_env.create_symintnode(symbol, hint=hint, source=source)
        return self.symbols[name]

    def symbol_names(self) -> dict[str, str]:
        """Map from the fake mode's symbol text ("s72") to our names ("T"), for printing."""
        return {str(value): name for name, value in self.symbols.items()}

    def fake_tensor(self, shape: list[int | str], dtype: torch.dtype) -> torch.Tensor:
        sizes = [self._size(dim) for dim in shape]
        with self.fake_mode:
            return torch.empty(sizes, dtype=dtype)

    def _size(self, dim: int | str):
        """An int, a symbol name ("B") or a symbol plus a constant ("B+1")."""
        if isinstance(dim, int):
            return dim
        name, _, offset = dim.partition("+")
        return self.symbol(name) + int(offset) if offset else self.symbol(name)

    def add_runtime_input(self, graph_module: GraphModule, name: str, shape: list[int | str],
                          dtype: torch.dtype, role: str) -> Node:
        """Add (or return) a placeholder the runtime feeds every step, e.g. slot_mapping [T]."""
        existing = _placeholder(graph_module, name)
        if existing is not None:
            return existing
        node = _insert_placeholder(graph_module, name)
        node.meta["val"] = self.fake_tensor(shape, dtype)
        self.runtime_inputs[name] = {"shape": list(shape), "dtype": _dtype_name(dtype), "role": role}
        return node

    def add_weight(self, graph_module: GraphModule, name: str, value: torch.Tensor) -> Node:
        """Add a weight placeholder holding `value` (created at compile time by a pass)."""
        if name in self.weights or _placeholder(graph_module, name) is not None:
            raise ValueError(f"weight {name} already exists")
        node = _insert_placeholder(graph_module, name)
        with self.fake_mode:
            node.meta["val"] = torch.empty(value.shape, dtype=value.dtype)
        self.weights[name] = value
        return node

    def remove_unused_weights(self, graph_module: GraphModule) -> int:
        """Drop weight placeholders nothing reads any more (and their tensors)."""
        removed = 0
        for node in list(graph_module.graph.nodes):
            if node.op == "placeholder" and node.name in self.weights and not node.users:
                graph_module.graph.erase_node(node)
                del self.weights[node.name]
                removed += 1
        return removed


def _placeholder(graph_module: GraphModule, name: str) -> Node | None:
    for node in graph_module.graph.nodes:
        if node.op == "placeholder" and node.name == name:
            return node
    return None


def _insert_placeholder(graph_module: GraphModule, name: str) -> Node:
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    with graph_module.graph.inserting_after(placeholders[-1]):
        node = graph_module.graph.placeholder(name)
    if node.name != name:
        raise ValueError(f"placeholder name {name} is taken by another node")
    return node


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
