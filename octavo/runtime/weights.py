"""Memory-mapped safetensors reading: weights are paged in by the OS, not copied at load."""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from octavo.errors import ArtifactError

# Every dtype safetensors' own torch loader reads.
_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}


def load_safetensors_mmap(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a .safetensors file as a view into one private (copy-on-write) mapping."""
    with open(path, "rb") as handle:
        try:
            header_size = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(header_size))
        except (ValueError, struct.error) as error:
            raise ArtifactError(f"{path} is not a valid safetensors file: {error}") from error
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    data_start = 8 + header_size
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ArtifactError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        if data_start + end > len(mapping):
            raise ArtifactError(f"{path} is truncated: tensor {name} ends past the end of the file")
        itemsize = torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(mapping, dtype=dtype, count=(end - begin) // itemsize,
                                offset=data_start + begin) if end > begin else torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(info["shape"])
    return tensors
