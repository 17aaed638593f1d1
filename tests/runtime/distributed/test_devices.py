"""One device per rank, for device counts this machine does not have (the mapping is checked by its logic).

The counts and CUDA_VISIBLE_DEVICES are passed to rank_device as a launcher
would leave them; no GPU is touched.
"""

from __future__ import annotations

import pytest
import torch

from octavo.errors import OctavoError
from octavo.runtime.distributed.collectives import backend_for
from octavo.runtime.distributed.devices import rank_device


@pytest.mark.parametrize("requested", ["cpu", "auto"])
def test_without_gpus_every_rank_computes_on_the_cpu(requested):
    assert {rank_device(requested, rank, 4, cuda_count=0) for rank in range(4)} == {torch.device("cpu")}


def test_cpu_is_kept_where_gpus_exist():
    assert rank_device("cpu", 1, 2, cuda_count=8) == torch.device("cpu")


@pytest.mark.parametrize("requested", ["cuda", "auto"])
def test_each_rank_of_a_node_takes_its_own_gpu(requested):
    devices = [rank_device(requested, rank, 4, cuda_count=4, visible_devices=None) for rank in range(4)]
    assert devices == [torch.device("cuda", rank) for rank in range(4)]


def test_fewer_ranks_than_gpus_take_the_first_ones():
    assert [rank_device("cuda", rank, 2, cuda_count=8) for rank in range(2)] == [torch.device("cuda", 0),
                                                                                torch.device("cuda", 1)]


def test_visible_devices_narrowed_the_gpus_to_the_listed_ones():
    """CUDA_VISIBLE_DEVICES=4,5 for every process: torch numbers them 0 and 1."""
    assert [rank_device("cuda", rank, 2, cuda_count=2, visible_devices="4,5") for rank in range(2)] == [
        torch.device("cuda", 0), torch.device("cuda", 1)]


def test_a_launcher_that_gives_each_rank_one_gpu_leaves_each_its_cuda_0():
    """SLURM's --gpus-per-task=1: every process sees one GPU, its own, under its own CUDA_VISIBLE_DEVICES."""
    assert [rank_device("cuda", rank, 4, cuda_count=1, visible_devices=str(rank)) for rank in range(4)] == [
        torch.device("cuda", 0)] * 4


@pytest.mark.parametrize(("cuda_count", "visible"), [(1, None), (2, None), (2, "0,1")])
def test_two_ranks_on_one_gpu_are_refused_naming_the_counts(cuda_count, visible):
    with pytest.raises(OctavoError, match=f"4 ranks on this node need one GPU each, but this process sees "
                                          f"{cuda_count}"):
        rank_device("cuda", 3, 4, cuda_count=cuda_count, visible_devices=visible)


def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(OctavoError, match="no CUDA device is available"):
        rank_device("cuda", 0, 2, cuda_count=0)


def test_nccl_carries_device_tensors_and_gloo_the_host_step_messages():
    assert backend_for(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"
    assert backend_for(torch.device("cpu")) == "gloo"
