"""CUDA graphs of decode steps: each ladder size captured once, then replayed.

A captured step reads its inputs from the decode buffers (fixed addresses) and
the KV cache tensors, and writes its logits into a tensor the graph owns; a
replay re-runs exactly the recorded kernel launches, so the executor's Python
code (and every launch's CPU cost) is paid once per size instead of once per
step. This needs kernels that never read a tensor value on the host (the
Triton backend's); a capture that fails disables graphs for the engine, with
one warning, and the step runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2
"""Eager runs before a capture: Triton compiles its kernels and the allocator settles on side streams."""


class CudaGraphs:
    """Captured decode graphs by ladder size; `run(size, step)` captures on first use, then replays."""

    def __init__(self) -> None:
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.enabled = True

    def run(self, size: int, step: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """The logits of `step` (the executor run on the buffers of `size`), or None when graphs are off.

        Running a captured step twice is harmless: it writes the same K/V to the same slots.
        """
        if not self.enabled:
            return None
        if size not in self.graphs:
            try:
                self.graphs[size] = self._capture(step)
            except RuntimeError as error:
                self.enabled = False
                logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", error)
                return None
        graph, logits = self.graphs[size]
        graph.replay()
        return logits

    def _capture(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                step()
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()
        return graph, logits
