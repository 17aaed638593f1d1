"""How a step travels between ranks: step messages, hidden states between stages, logits back to rank 0.

Rank 0 sends each step once: its header point to point to the other ranks of
stage 0 and to stage 1, its payload in one broadcast over stage 0's
tensor-parallel group and point to point to stage 1. Every later stage
passes both on to the next, together with the hidden states it computed, so
a stage never waits on rank 0 directly. The last stage's first rank sends the
logits to rank 0. Sends are asynchronous: a send completes when its receiver
takes it, and the sender waits for it (with the collective timeout) before
its next send on that link, so a stage can start the next step while the
following stage still finishes the previous one.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from octavo.runtime.distributed.collectives import IDLE_TIMEOUT, RankGroups
from octavo.runtime.distributed.protocol import HEADER_SIZE, StepMessage, decode, payload_size

_HEADER_TAG, _PAYLOAD_TAG, _HIDDEN_TAG, _LOGITS_TAG = 1, 2, 3, 4


class StepTransport:
    """One rank's end of the step traffic (see the module docstring)."""

    def __init__(self, groups: RankGroups, input_names: list[str], input_dtypes: dict[str, torch.dtype],
                 device: torch.device):
        self.groups = groups
        self.device = device  # hidden states and logits travel as device tensors (NCCL on CUDA)
        self.rank = groups.rank
        self.topology = groups.topology
        self.position = self.topology.position(self.rank)
        self.input_names = input_names
        self.input_dtypes = input_dtypes
        self.timeout: datetime.timedelta = groups.timeout
        self.next_rank = self.topology.next_in_pipeline(self.rank)
        self.previous_rank = self.topology.previous_in_pipeline(self.rank)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    # ---- step messages ----

    def send_step(self, message: StepMessage) -> None:
        """Rank 0: send the step to every rank (see the module docstring)."""
        header, payload = message.encode(self.input_names)
        self.flush()
        for peer in self.topology.stage_ranks(0)[1:]:
            self._send(header, peer, _HEADER_TAG)
        if self.position.tp_size > 1:
            dist.broadcast(payload, src=self.rank, group=self.groups.tp_group)
        self._forward(header, payload)

    def receive_step(self) -> StepMessage:
        """Any other rank: wait (as long as the engine idles) for the next step, and pass it on."""
        source = 0 if self.position.pp_rank == 0 else self.previous_rank
        header = torch.empty(HEADER_SIZE, dtype=torch.int64)
        dist.irecv(header, source, tag=_HEADER_TAG).wait(timeout=IDLE_TIMEOUT)
        payload = torch.empty(payload_size(header, self.input_names), dtype=torch.int64)
        if self.position.pp_rank == 0:
            dist.broadcast(payload, src=0, group=self.groups.tp_group)
        else:
            dist.irecv(payload, source, tag=_PAYLOAD_TAG).wait(timeout=self.timeout)
        self.flush()
        self._forward(header, payload)
        return decode(header, payload, self.input_names, self.input_dtypes)

    def _forward(self, header: torch.Tensor, payload: torch.Tensor) -> None:
        if self.next_rank is not None:
            self._send(header, self.next_rank, _HEADER_TAG)
            self._send(payload, self.next_rank, _PAYLOAD_TAG)

    # ---- hidden states and logits ----

    def send_hidden(self, values: tuple[torch.Tensor, ...]) -> None:
        """This stage's boundary values, as one byte buffer, to the same tensor-parallel rank of the next stage."""
        packed = torch.cat([value.detach().contiguous().view(torch.uint8).reshape(-1) for value in values])
        self._send(packed, self.next_rank, _HIDDEN_TAG)

    def receive_hidden(self, specs: list[dict], sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """The previous stage's boundary values, named as this stage's graph inputs."""
        shapes = [[sizes[dim] if isinstance(dim, str) else dim for dim in spec["shape"]] for spec in specs]
        dtypes = [getattr(torch, spec["dtype"]) for spec in specs]
        counts = [_numel(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in zip(shapes, dtypes,
                                                                                                      strict=True)]
        packed = torch.empty(sum(counts), dtype=torch.uint8, device=self.device)
        dist.irecv(packed, self.previous_rank, tag=_HIDDEN_TAG).wait(timeout=self.timeout)
        values, offset = {}, 0
        for spec, shape, dtype, count in zip(specs, shapes, dtypes, counts, strict=True):
            values[spec["name"]] = packed[offset:offset + count].view(dtype).view(shape)
            offset += count
        return values

    def send_logits(self, logits: torch.Tensor) -> None:
        self._send(logits.contiguous(), 0, _LOGITS_TAG)

    def receive_logits(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        logits = torch.empty(shape, dtype=dtype, device=self.device)
        dist.irecv(logits, self.topology.last_stage_first_rank, tag=_LOGITS_TAG).wait(timeout=self.timeout)
        return logits

    # ---- sends ----

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self._pending.append((dist.isend(tensor, peer, tag=tag), tensor))

    def flush(self) -> None:
        """Wait until every earlier send was taken by its receiver (the collective timeout each)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait(timeout=self.timeout)


def step_sizes(inputs: dict[str, torch.Tensor]) -> dict[str, int]:
    """The runtime sizes of a step, by the names the stage specs use."""
    return {"T": int(inputs["input_ids"].shape[0]), "B": int(inputs["seq_lens"].shape[0]),
            "N": int(inputs["logits_indices"].shape[0])}


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
