"""The message rank 0 sends every rank once per step: a fixed-size header, then one int64 payload.

The header (HEADER_SIZE int64) holds the opcode, the step number, the counts
of KV block moves and the shape of every step input; the payload is all of
them flattened into one int64 tensor: copy-on-write pairs, swap-out pairs,
swap-in pairs, then the step inputs in the order of `input_names`. Sending
sizes first lets the receiver allocate the payload before it arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from octavo.errors import OctavoError

HEADER_SIZE = 64
STEP = 1
SHUTDOWN = 2
_FIXED = 5  # opcode, step, copies, swap-outs, swap-ins
_MAX_DIMS = 2


@dataclass
class StepMessage:
    """One step for every rank: the graph's step inputs and the KV block moves to make before running it."""

    opcode: int
    step: int
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def encode(self, input_names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(header, payload): int64 tensors of HEADER_SIZE and of the summed sizes."""
        header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        header[:_FIXED] = torch.tensor([self.opcode, self.step, len(self.copies), len(self.swap_out),
                                        len(self.swap_in)])
        parts = [_pairs(self.copies), _pairs(self.swap_out), _pairs(self.swap_in)]
        if self.opcode == STEP:
            if _FIXED + len(input_names) * (1 + _MAX_DIMS) > HEADER_SIZE:
                raise OctavoError(f"{len(input_names)} step inputs do not fit the step message header")
            for index, name in enumerate(input_names):
                tensor = self.inputs[name]
                if tensor.dim() > _MAX_DIMS or tensor.dtype.is_floating_point:
                    raise OctavoError(f"step input {name} ({tensor.dtype}, {tensor.dim()} dims) cannot be sent: "
                                      f"only integer tensors of up to {_MAX_DIMS} dims")
                slot = _FIXED + index * (1 + _MAX_DIMS)
                header[slot] = tensor.dim()
                header[slot + 1:slot + 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
                parts.append(tensor.reshape(-1).to(torch.int64))
        return header, torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def payload_size(header: torch.Tensor, input_names: list[str]) -> int:
    values = header.tolist()
    size = 2 * (values[2] + values[3] + values[4])
    if values[0] == STEP:
        for index in range(len(input_names)):
            slot = _FIXED + index * (1 + _MAX_DIMS)
            shape = values[slot + 1:slot + 1 + values[slot]]
            size += _numel(shape)
    return size


def decode(header: torch.Tensor, payload: torch.Tensor, input_names: list[str],
           input_dtypes: dict[str, torch.dtype]) -> StepMessage:
    """The StepMessage of `encode`, step inputs in their graph dtypes."""
    values = header.tolist()
    message = StepMessage(values[0], values[1])
    offset = 0
    for name, count in (("copies", values[2]), ("swap_out", values[3]), ("swap_in", values[4])):
        pairs = payload[offset:offset + 2 * count].view(count, 2).tolist()
        setattr(message, name, [tuple(pair) for pair in pairs])
        offset += 2 * count
    if message.opcode == STEP:
        for index, name in enumerate(input_names):
            slot = _FIXED + index * (1 + _MAX_DIMS)
            shape = values[slot + 1:slot + 1 + values[slot]]
            count = _numel(shape)
            message.inputs[name] = payload[offset:offset + count].view(shape).to(input_dtypes[name])
            offset += count
    return message


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1)


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
