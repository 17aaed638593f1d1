"""The paged KV cache: per-layer key and value pools sized from a memory budget."""

from __future__ import annotations

import logging

import psutil
import torch

from octavo.errors import OctavoError

logger = logging.getLogger(__name__)

# Without a budget, the CPU pool takes this share of available memory, capped.
_DEFAULT_CPU_FRACTION = 0.25
_DEFAULT_CPU_CAP = 4 * 2**30
_DEFAULT_GPU_FRACTION = 0.8


class KVCache:
    """Key/value pools, one pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim].

    The pools are allocated uninitialized: memory is committed as blocks are
    first written, and kernels never let a slot that was not written this
    sequence's lifetime influence a result (they mask by sequence length).
    """

    def __init__(self, kv_layout: dict, num_blocks: int, device: torch.device):
        self.layout = kv_layout
        self.num_blocks = num_blocks
        self.block_size = kv_layout["block_size"]
        dtype = getattr(torch, kv_layout["cache_dtype"])
        shape = (num_blocks, self.block_size, kv_layout["num_kv_heads"], kv_layout["head_dim"])
        self.tensors: dict[str, torch.Tensor] = {}
        for key_name, value_name in kv_layout["cache_inputs"]:
            self.tensors[key_name] = torch.empty(shape, dtype=dtype, device=device)
            self.tensors[value_name] = torch.empty(shape, dtype=dtype, device=device)

    @property
    def num_bytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors.values())


def bytes_per_block(kv_layout: dict) -> int:
    """Bytes of one block across all layers, keys and values."""
    itemsize = torch.empty((), dtype=getattr(torch, kv_layout["cache_dtype"])).element_size()
    per_layer = kv_layout["block_size"] * kv_layout["num_kv_heads"] * kv_layout["head_dim"] * itemsize
    return 2 * kv_layout["num_layers"] * per_layer


def choose_num_blocks(kv_layout: dict, memory_bytes: int | None, num_blocks: int | None,
                      device: torch.device) -> int:
    """The pool size: explicit `num_blocks`, else `memory_bytes` / bytes per block, else a share of free memory."""
    if num_blocks is not None:
        if num_blocks < 1:
            raise OctavoError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        return num_blocks
    if memory_bytes is None:
        memory_bytes = _default_memory(device)
    blocks = memory_bytes // bytes_per_block(kv_layout)
    if blocks < 1:
        raise OctavoError(f"kv_cache_memory of {memory_bytes} bytes holds no block "
                          f"({bytes_per_block(kv_layout)} bytes each)")
    return int(blocks)


def _default_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * _DEFAULT_GPU_FRACTION)
    return int(min(psutil.virtual_memory().available * _DEFAULT_CPU_FRACTION, _DEFAULT_CPU_CAP))
