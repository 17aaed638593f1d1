"""What every rank builds at start: its program, executor and KV cache, sized in agreement with the others."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from octavo.config import EngineConfig, RankPosition
from octavo.runtime.distributed.collectives import RankGroups, lower_collectives
from octavo.runtime.distributed.transport import step_sizes
from octavo.runtime.executor_choice import create_executor
from octavo.runtime.kv_cache import KVCache, bytes_per_block, choose_num_blocks

logger = logging.getLogger(__name__)

_CACHE_ROLES = ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache")


def step_input_names(manifest: dict) -> list[str]:
    """The graph inputs rank 0 sends each step (every runtime input but the KV caches), in signature order."""
    return [name for name, spec in manifest["signature"]["inputs"].items() if spec["role"] not in _CACHE_ROLES]


def step_input_dtypes(manifest: dict) -> dict[str, torch.dtype]:
    return {name: getattr(torch, spec["dtype"]) for name, spec in manifest["signature"]["inputs"].items()}


class RankProgram(Protocol):
    """What one rank runs, as the parallel passes make it (octavo.passes.rank_program.RankProgram)."""

    position: RankPosition
    graph_module: torch.fx.GraphModule
    weights: dict[str, torch.Tensor]
    kv_layout: dict
    pipeline_stage: dict | None


@dataclass
class RankState:
    """A rank's executor over its program and its share of the KV cache."""

    program: RankProgram
    executor: object  # GraphExecutor or CompiledExecutor
    kv_cache: KVCache
    num_host_blocks: int


def cache_size_candidates(program: RankProgram, config: EngineConfig, device: torch.device) -> tuple[int, int]:
    """(device blocks, host blocks) this rank could hold; the engine takes the minimum over the ranks."""
    layout = program.kv_layout
    num_blocks = choose_num_blocks(layout, config.kv_cache_memory, config.num_kv_blocks, device)
    swap = config.preemption_mode == "swap"
    return num_blocks, max(1, int(config.swap_space // bytes_per_block(layout))) if swap else 0


def agree_on_minimum(values: tuple[int, ...]) -> tuple[int, ...]:
    """The element-wise minimum of `values` over all ranks (one all_reduce on the world group)."""
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tuple(int(value) for value in tensor.tolist())


def build_rank_state(program: RankProgram, manifest: dict, groups: RankGroups, config: EngineConfig, backend: str,
                     device: torch.device, cache_class: type[KVCache] = KVCache) -> RankState:
    """Agree on the cache size with the other ranks, allocate this rank's share, build the executor.

    The executor is the one config.executor chooses, as for a single-process
    engine: compiled (AOTInductor) on CPU, with a package per rank keyed by
    the artifact, the rank's position and the world size.
    """
    num_blocks, num_host_blocks = agree_on_minimum(cache_size_candidates(program, config, device))
    kv_cache = cache_class(program.kv_layout, num_blocks, device, num_host_blocks)
    graph_module = lower_collectives(program.graph_module)
    position = program.position
    scope = {"rank": position.rank, "tp_size": position.tp_size, "pp_size": position.pp_size}
    executor = create_executor(graph_module, program.weights, manifest, backend, device, config.executor,
                               getattr(torch, manifest["dtype"]), scope)
    logger.info("rank %d: %d KV blocks (%.1f MiB, %d kv heads x %d layers), executor %s", groups.rank, num_blocks,
                kv_cache.num_bytes / 2**20, program.kv_layout["num_kv_heads"], program.kv_layout["num_layers"],
                executor.kind)
    # A rank that compiles its program takes minutes; no rank may start a step (whose collectives have the
    # collective timeout) before every rank is ready to run it.
    agree_on_minimum((1,))
    return RankState(program, executor, kv_cache, num_host_blocks)


def run_step(state: RankState, transport, message, feed: dict[str, torch.Tensor] | None = None):
    """Run one step of this rank's program; returns the logits, or None when they are not this rank's to return.

    `feed` (rank 0) already holds the step inputs and the KV caches, and rank
    0's engine made the block moves itself; the other ranks make them here,
    in the engine's order (swap-outs read their blocks first, then
    copy-on-write, then swap-ins).
    """
    if feed is None:
        kv_cache = state.kv_cache
        kv_cache.swap_out(message.swap_out)
        kv_cache.copy_blocks(message.copies)
        kv_cache.swap_in(message.swap_in)
        device = kv_cache.device
        feed = {**{name: value.to(device) for name, value in message.inputs.items()}, **kv_cache.tensors}
    stage = state.program.pipeline_stage
    if stage is not None and stage["inputs"]:
        feed.update(transport.receive_hidden(stage["inputs"], step_sizes(message.inputs)))
    result = state.executor.run(feed)
    if stage is not None and stage["outputs"]:
        transport.send_hidden(result)
        return None
    return result
