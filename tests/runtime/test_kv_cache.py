"""The KV pool: block moves (copy-on-write, swap out, swap in) and sizing from a memory budget."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from octavo.config import EngineConfig
from octavo.errors import OctavoError
from octavo.runtime.engine import LLMEngine
from octavo.runtime.kv_cache import KVCache, bytes_per_block, choose_num_blocks
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full

pytestmark = pytest.mark.usefixtures("one_thread")

LAYOUT = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 5, "block_size": 4, "cache_dtype": "float32",
          "cache_inputs": [[f"key_cache_{layer}", f"value_cache_{layer}"] for layer in range(3)]}
# The tiny llama artifact: 2 layers x (K, V) x 16 slots x 2 kv heads x 16 dims x 4 bytes.
TINY_BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4


def filled_cache(num_blocks: int = 6, num_host_blocks: int = 4) -> KVCache:
    """A cache whose every element is distinct (device values >= 0, host values < 0)."""
    cache = KVCache(LAYOUT, num_blocks, torch.device("cpu"), num_host_blocks)
    for offset, tensor in enumerate(cache.tensors.values()):
        tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).view_as(tensor) + offset * 10**6)
    for offset, tensor in enumerate(cache.host_tensors.values()):
        tensor.copy_(-1 - torch.arange(tensor.numel(), dtype=torch.float32).view_as(tensor) - offset * 10**6)
    return cache


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in tensors.items()}


def test_cache_has_one_key_and_one_value_pool_per_layer():
    cache = KVCache(LAYOUT, 6, torch.device("cpu"), 4)
    assert sorted(cache.tensors) == sorted(name for pair in LAYOUT["cache_inputs"] for name in pair)
    assert all(tensor.shape == (6, 4, 2, 5) and tensor.dtype == torch.float32 for tensor in cache.tensors.values())
    assert all(tensor.shape == (4, 4, 2, 5) for tensor in cache.host_tensors.values())
    assert cache.num_bytes == 6 * bytes_per_block(LAYOUT)
    assert KVCache(LAYOUT, 6, torch.device("cpu")).host_tensors == {}


def _mapping_of(address: int) -> list[str]:
    """The /proc/self/smaps lines of the memory mapping that holds `address`."""
    lines, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(char in "0123456789abcdef-" for char in head):
            low, high = (int(bound, 16) for bound in head.split("-"))
            inside = low <= address < high
        elif inside:
            lines.append(line)
    return lines


def _transparent_huge_pages(setting: str) -> str:
    """The kernel's THP `setting` ("enabled": always / madvise / never; "defrag": always / defer /
    defer+madvise / madvise / never), or "" where it has none."""
    path = Path("/sys/kernel/mm/transparent_hugepage") / setting
    return path.read_text().split("[")[1].split("]")[0] if path.exists() else ""


def test_large_cpu_pools_are_separate_and_on_huge_pages_only_where_faulting_them_never_compacts():
    """Pools of 2 MB and more come from their own anonymous mappings, advised for huge pages where Linux maps
    them without compacting memory in the fault (THP defrag "defer" or "never"; THPeligible in smaps); each is
    a plain writable tensor of its own."""
    layout = {**LAYOUT, "num_kv_heads": 4, "head_dim": 64, "block_size": 16}
    cache = KVCache(layout, 256, torch.device("cpu"))  # 256 x 16 x 4 x 64 x 4 bytes = 4 MB a pool
    tensors = list(cache.tensors.values())
    assert all(tensor.shape == (256, 16, 4, 64) and tensor.is_contiguous() for tensor in tensors)
    for index, tensor in enumerate(tensors):
        tensor.fill_(index)
    assert [int(tensor[-1, -1, -1, -1]) for tensor in tensors] == list(range(len(tensors)))
    cache.copy_blocks([(0, 255)])
    assert torch.equal(tensors[0][255], tensors[0][0])
    smaps = Path("/proc/self/smaps")
    if smaps.exists() and "THPeligible:" in smaps.read_text():
        enabled, defrag = _transparent_huge_pages("enabled"), _transparent_huge_pages("defrag")
        advised = enabled == "madvise" and defrag in ("defer", "never")
        expected = ["1"] if enabled == "always" or advised else ["0"]
        for tensor in tensors:
            eligible = [line.split()[1] for line in _mapping_of(tensor.data_ptr()) if line.startswith("THPeligible:")]
            assert eligible == expected, (enabled, defrag)


def test_copy_blocks_moves_exactly_the_given_blocks_in_every_layer():
    cache = filled_cache()
    before, host_before = snapshot(cache.tensors), snapshot(cache.host_tensors)
    cache.copy_blocks([(1, 5), (3, 0)])
    for name, tensor in cache.tensors.items():
        assert torch.equal(tensor[5], before[name][1]) and torch.equal(tensor[0], before[name][3])
        for block in (1, 2, 3, 4):
            assert torch.equal(tensor[block], before[name][block]), f"{name} block {block} changed"
    assert all(torch.equal(tensor, host_before[name]) for name, tensor in cache.host_tensors.items())


def test_copy_blocks_of_no_pairs_changes_nothing():
    cache = filled_cache()
    before, host_before = snapshot(cache.tensors), snapshot(cache.host_tensors)
    cache.copy_blocks([])
    assert all(torch.equal(tensor, before[name]) for name, tensor in cache.tensors.items())
    assert all(torch.equal(tensor, host_before[name]) for name, tensor in cache.host_tensors.items())


def test_swap_out_copies_device_blocks_into_the_given_host_blocks():
    cache = filled_cache()
    before, host_before = snapshot(cache.tensors), snapshot(cache.host_tensors)
    cache.swap_out([(2, 1), (4, 0)])
    for name, host in cache.host_tensors.items():
        assert torch.equal(host[1], before[name][2]) and torch.equal(host[0], before[name][4])
        for block in (2, 3):
            assert torch.equal(host[block], host_before[name][block])
    assert all(torch.equal(tensor, before[name]) for name, tensor in cache.tensors.items()), "the device is read only"


def test_swap_in_copies_host_blocks_into_the_given_device_blocks():
    cache = filled_cache()
    before, host_before = snapshot(cache.tensors), snapshot(cache.host_tensors)
    cache.swap_in([(1, 3), (2, 0)])
    for name, tensor in cache.tensors.items():
        assert torch.equal(tensor[3], host_before[name][1]) and torch.equal(tensor[0], host_before[name][2])
        for block in (1, 2, 4, 5):
            assert torch.equal(tensor[block], before[name][block])
    assert all(torch.equal(host, host_before[name]) for name, host in cache.host_tensors.items())


def test_swap_out_then_in_restores_a_block_elsewhere():
    cache = filled_cache()
    original = {name: tensor[4].clone() for name, tensor in cache.tensors.items()}
    cache.swap_out([(4, 3)])
    cache.tensors["key_cache_0"][4].zero_()  # the device block is reused meanwhile
    cache.swap_in([(3, 1)])
    assert all(torch.equal(cache.tensors[name][1], block) for name, block in original.items())


def test_pool_size_from_a_memory_budget():
    assert bytes_per_block(LAYOUT) == 2 * 3 * 4 * 2 * 5 * 4
    cpu = torch.device("cpu")
    assert choose_num_blocks(LAYOUT, 10 * bytes_per_block(LAYOUT) + 1, None, cpu) == 10
    assert choose_num_blocks(LAYOUT, 10**9, 7, cpu) == 7, "an explicit block count wins"
    with pytest.raises(OctavoError, match="holds no block"):
        choose_num_blocks(LAYOUT, bytes_per_block(LAYOUT) - 1, None, cpu)
    with pytest.raises(OctavoError, match="num_kv_blocks must be >= 1"):
        choose_num_blocks(LAYOUT, None, 0, cpu)
    assert choose_num_blocks(LAYOUT, None, None, cpu) >= 1  # a share of available memory


# ---- the engine's pool ----

def test_kv_cache_memory_gives_the_expected_number_of_blocks(artifact, caplog):
    assert bytes_per_block(artifact.manifest["kv_layout"]) == TINY_BYTES_PER_BLOCK
    with caplog.at_level("INFO", logger="octavo.runtime.engine"):
        engine = LLMEngine(artifact, EngineConfig(kv_cache_memory="1MiB"))
    assert engine.block_manager.num_blocks == 2**20 // TINY_BYTES_PER_BLOCK == 128
    assert engine.kv_cache.num_bytes == 128 * TINY_BYTES_PER_BLOCK
    assert all(tensor.shape[0] == 128 for tensor in engine.kv_cache.tensors.values())
    assert "KV cache: 128 blocks x 16 tokens = 2048 token slots, 1.0 MiB" in caplog.text
    small = LLMEngine(artifact, EngineConfig(kv_cache_memory=5 * TINY_BYTES_PER_BLOCK + 100))
    assert small.block_manager.num_blocks == 5 and small.max_model_len == 80
    swapping = LLMEngine(artifact, EngineConfig(num_kv_blocks=4, preemption_mode="swap", swap_space="64KiB"))
    assert swapping.scheduler.host_pool.num_blocks == 8
    assert all(tensor.shape[0] == 8 for tensor in swapping.kv_cache.host_tensors.values())
    for idle in (engine, small, swapping):
        assert_pool_full(idle)
    with pytest.raises(OctavoError, match="holds no block"):
        LLMEngine(artifact, EngineConfig(kv_cache_memory="1KiB"))


def test_a_request_that_can_never_fit_is_rejected_alone(artifact):
    from octavo.llm import LLM

    llm = LLM(artifact.path, kv_cache_memory="48KiB")  # 6 blocks: 96 token slots
    assert llm.engine.max_model_len == 96
    rng = random.Random(1)
    too_long = [rng.randrange(3, 49000) for _ in range(120)]
    nearly_full = [rng.randrange(3, 49000) for _ in range(90)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7], too_long, nearly_full], params)
    rejected = outputs[1]
    assert rejected.finished and rejected.outputs == []
    assert rejected.error == ("the prompt has 120 tokens, but the model's max_model_len is 96, limited by the KV "
                              "cache size (raise kv_cache_memory); the prompt plus at least one generated token "
                              "must fit")
    assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == 20
    assert outputs[2].error is None
    completion = outputs[2].outputs[0]
    assert len(completion.token_ids) == 6 and completion.finish_reason == "length", "capped at the pool's 96 tokens"
    assert_pool_full(llm.engine)
