"""The paged KV cache: per-layer key and value pools sized from a memory budget."""

from __future__ import annotations

import functools
import logging
import math
import mmap
from pathlib import Path

import psutil
import torch

from octavo.errors import OctavoError

logger = logging.getLogger(__name__)

# Without a budget, the CPU pool takes this share of available memory, capped.
_DEFAULT_CPU_FRACTION = 0.25
_DEFAULT_CPU_CAP = 4 * 2**30
_DEFAULT_GPU_FRACTION = 0.8
_HUGE_PAGE_BYTES = 2 * 2**20
_THP_DEFRAG = Path("/sys/kernel/mm/transparent_hugepage/defrag")


class KVCache:
    """Key/value pools, one pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim].

    The pools are allocated uninitialized: memory is committed as blocks are
    first written, and kernels never let a slot that was not written this
    sequence's lifetime influence a result (they mask by sequence length).
    A quantized cache (kv_layout "scale_inputs") also has, per layer, key and
    value scale pools [num_blocks, block_size, num_kv_heads] of "scale_dtype";
    they are graph inputs like the caches and move with their blocks.
    """

    def __init__(self, kv_layout: dict, num_blocks: int, device: torch.device, num_host_blocks: int = 0):
        self.layout = kv_layout
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = kv_layout["block_size"]
        self.device = device
        pools = pool_shapes(kv_layout)
        self.tensors: dict[str, torch.Tensor] = {name: allocate_pool((num_blocks, *shape), dtype, device)
                                                 for name, (shape, dtype) in pools.items()}
        # The host pool that swap preemption copies to: pinned on CUDA, a second CPU pool on CPU.
        pin = device.type == "cuda"
        self.host_tensors: dict[str, torch.Tensor] = {
            name: torch.empty((num_host_blocks, *shape), dtype=dtype, pin_memory=pin)
            for name, (shape, dtype) in pools.items()} if num_host_blocks else {}

    @property
    def num_bytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors.values())

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Device block contents source -> destination, for every layer (copy-on-write)."""
        if pairs:
            source, destination = self._indices(pairs, self.device)
            for tensor in self.tensors.values():
                tensor = _copyable(tensor)
                tensor.index_copy_(0, destination, tensor.index_select(0, source))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs: copy device contents into the host pool."""
        if pairs:
            device_ids, host_ids = self._indices(pairs, self.device)
            host_ids = host_ids.cpu()
            for name, tensor in self.tensors.items():
                blocks = _copyable(tensor).index_select(0, device_ids).cpu()
                _copyable(self.host_tensors[name]).index_copy_(0, host_ids, blocks)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs: copy host contents back into the device pool."""
        if pairs:
            host_ids, device_ids = self._indices(pairs, torch.device("cpu"))
            device_ids = device_ids.to(self.device)
            for name, tensor in self.tensors.items():
                host = _copyable(self.host_tensors[name])
                blocks = host.index_select(0, host_ids).to(self.device, non_blocking=True)
                _copyable(tensor).index_copy_(0, device_ids, blocks)

    @staticmethod
    def _indices(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.tensor(pairs, dtype=torch.int64, device=device)
        return table[:, 0], table[:, 1]


def pool_shapes(kv_layout: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every pool's per-block shape and dtype, by graph input name: caches, then scale pools (if quantized)."""
    block_size, heads = kv_layout["block_size"], kv_layout["num_kv_heads"]
    cache = ((block_size, heads, kv_layout["head_dim"]), getattr(torch, kv_layout["cache_dtype"]))
    pools = {name: cache for pair in kv_layout["cache_inputs"] for name in pair}
    if kv_layout.get("scale_inputs"):
        scale = ((block_size, heads), getattr(torch, kv_layout["scale_dtype"]))
        pools.update({name: scale for pair in kv_layout["scale_inputs"] for name in pair})
    return pools


def bytes_per_block(kv_layout: dict) -> int:
    """Bytes of one block across all layers, keys and values (and their scales)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in pool_shapes(kv_layout).values())


def allocate_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized pool; on CPU, a mapping of its own, advised for huge pages where faulting them is cheap.

    Decode attention reads a batch's blocks scattered over the pool, a few KB each: on 4 KB pages nearly
    every block is a TLB miss, and the read-ahead of the next work item's lines waits on them (2 MB pages
    made the op 10-20% faster). Memory is committed as it is first written, and a fresh engine writes new
    blocks all the time until it has used the whole pool once. Where the kernel compacts memory before it
    maps a huge page into an advised region (THP defrag "always", "madvise", "defer+madvise"), that first
    write stalls: 0.10-0.15 GB/s against 2.8 GB/s on 4 KB pages on a machine with its memory partly page
    cache, which cost a fresh engine 30% of its throughput. So the pool is advised only where such faults
    never compact in line (defrag "defer" or "never": a free 2 MB page or 4 KB ones at once).
    """
    if device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes < _HUGE_PAGE_BYTES:
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_page_faults_never_compact():
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


@functools.cache
def huge_page_faults_never_compact() -> bool:
    """Whether Linux maps a huge page into an advised region without compacting memory first (THP defrag mode
    "defer" or "never"); False where the mode cannot be read."""
    try:
        mode = _THP_DEFRAG.read_text()
    except OSError:
        return False
    selected = mode.split("[")[1].split("]")[0] if "[" in mode else ""
    return selected in ("defer", "never")


def _copyable(tensor: torch.Tensor) -> torch.Tensor:
    # index_copy_ has no float8 kernel: move float8 blocks as the bytes they are.
    return tensor.view(torch.int8) if tensor.dtype == torch.float8_e4m3fn else tensor


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
