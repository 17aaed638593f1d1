"""One device per rank: which CUDA device a rank uses, chosen before its process group is created.

NCCL refuses two ranks of one communicator on one GPU, so the ranks of a
node must each take their own: rank `local_rank` takes ``cuda:{local_rank}``
of the devices this process sees (``CUDA_VISIBLE_DEVICES`` already narrows
and renumbers them). A launcher that gives each process exactly one visible
GPU (SLURM's ``--gpus-per-task=1``, some Kubernetes operators) leaves every
rank ``cuda:0``, its own. Anything else that would put two ranks on one
device is an error naming the counts. On CPU every rank is ``cpu``.
"""

from __future__ import annotations

import os

import torch

from octavo.errors import OctavoError

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


def rank_device(requested: str, local_rank: int, local_world_size: int, cuda_count: int | None = None,
                visible_devices: str | None = None) -> torch.device:
    """The device of the rank `local_rank` of `local_world_size` ranks on this node.

    `requested` is the engine's device option (auto, cpu, cuda). `cuda_count`
    (devices this process sees) and `visible_devices` (CUDA_VISIBLE_DEVICES)
    default to this process's; tests pass them.
    """
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible_devices is None:
        visible_devices = os.environ.get(VISIBLE_DEVICES_ENV)
    if requested == "cpu" or (requested == "auto" and cuda_count == 0):
        return torch.device("cpu")
    if requested not in ("auto", "cuda"):
        raise OctavoError(f"device must be auto, cpu or cuda, got {requested!r}")
    if cuda_count == 0:
        raise OctavoError("device cuda requested but no CUDA device is available")
    if cuda_count >= local_world_size:
        return torch.device("cuda", local_rank)
    if cuda_count == 1 and visible_devices:
        return torch.device("cuda", 0)  # the launcher gave this process its own GPU
    raise _too_few(local_world_size, cuda_count, visible_devices)


def _too_few(local_world_size: int, cuda_count: int, visible_devices: str | None) -> OctavoError:
    seen = f"{VISIBLE_DEVICES_ENV}={visible_devices}" if visible_devices is not None else "all of the node's"
    return OctavoError(f"{local_world_size} ranks on this node need one GPU each, but this process sees "
                       f"{cuda_count} ({seen}); start fewer ranks per node or give each rank its own GPU")


def bind_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device (before NCCL creates its communicators)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
