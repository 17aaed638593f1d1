"""load_safetensors_mmap against safetensors' own loader, for every dtype safetensors can write."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from octavo.errors import ArtifactError
from octavo.runtime.weights import load_safetensors_mmap

ALL_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
    torch.complex64, torch.uint64, torch.uint32, torch.uint16,
]
# Odd sizes first, so the tensors after them start at offsets that are not multiples of their itemsize.
SHAPES = [(3, 5), (7,), (), (0, 4), (2, 3, 2)]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random bit patterns of `dtype` (NaNs and infinities included for float types)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for dim in shape:
        numel *= dim
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def mapped_files(address: int) -> list[str]:
    """Paths of the /proc/self/maps regions that contain `address`."""
    paths = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(part, 16) for part in fields[0].split("-"))
        if start <= address < end:
            paths.append(fields[5] if len(fields) == 6 else "")
    return paths


@pytest.fixture(scope="module")
def every_dtype_file(tmp_path_factory) -> Path:
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for dtype in ALL_DTYPES:
        for shape in SHAPES:
            tensors[f"{str(dtype).removeprefix('torch.')}/{'x'.join(map(str, shape)) or 'scalar'}"] = (
                random_tensor(dtype, shape, generator))
    path = tmp_path_factory.mktemp("weights") / "all.safetensors"
    save_file(tensors, path, metadata={"note": "every dtype"})
    return path


def test_every_dtype_matches_safetensors_load_file(every_dtype_file):
    ours = load_safetensors_mmap(every_dtype_file)
    theirs = load_file(every_dtype_file)
    assert sorted(ours) == sorted(theirs)
    for name, expected in theirs.items():
        tensor = ours[name]
        assert tensor.dtype == expected.dtype, name
        assert tensor.shape == expected.shape, name
        assert as_bytes(tensor) == as_bytes(expected), name


def test_tensors_are_views_of_one_mapping_of_the_file(every_dtype_file):
    tensors = load_safetensors_mmap(every_dtype_file)
    raw = every_dtype_file.read_bytes()
    header_size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + header_size])
    nonempty = {name: tensor for name, tensor in tensors.items() if tensor.numel()}
    base = min(tensor.data_ptr() - header[name]["data_offsets"][0] for name, tensor in nonempty.items())
    for name, tensor in nonempty.items():
        # Each tensor sits at its recorded offset from the start of the data section: no copies.
        assert tensor.data_ptr() - base == header[name]["data_offsets"][0], name
        assert str(every_dtype_file) in mapped_files(tensor.data_ptr()), name


def test_the_mapping_is_private_writes_never_reach_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.arange(8, dtype=torch.float32)}, path)
    before = path.read_bytes()
    tensor = load_safetensors_mmap(path)["weight"]
    tensor.add_(100.0)
    assert tensor.tolist() == [100.0 + value for value in range(8)]
    assert path.read_bytes() == before
    assert load_safetensors_mmap(path)["weight"].tolist() == list(map(float, range(8)))


def test_unknown_dtype_is_an_artifact_error_naming_the_tensor(tmp_path):
    header = json.dumps({"strange": {"dtype": "Q3", "shape": [2], "data_offsets": [0, 2]}}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    with pytest.raises(ArtifactError, match="tensor strange has unsupported dtype Q3"):
        load_safetensors_mmap(path)


def test_garbage_header_is_an_artifact_error(tmp_path):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(struct.pack("<Q", 12) + b"not json!!!!" + b"\0" * 16)
    with pytest.raises(ArtifactError, match="not a valid safetensors file"):
        load_safetensors_mmap(path)


@pytest.mark.parametrize(("keep", "message"), [(4, "not a valid safetensors file"), (-100, "is truncated")],
                         ids=["inside-the-size-field", "inside-the-data"])
def test_truncated_file_is_an_artifact_error(tmp_path, keep, message):
    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.arange(64, dtype=torch.float32)}, path)  # 256 data bytes
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ArtifactError, match=message):
        load_safetensors_mmap(path)
