"""The artifact format: file names, format version and file hashing, shared by the writer and the loader.

codegen writes an artifact with these names and hashes; the runtime reads and
verifies it with the same ones. Layout of an artifact directory (see
docs/architecture.md, "The artifact"): MANIFEST, GRAPH, WEIGHTS, TOKENIZER_DIR/,
KERNELS_DIR/. The manifest's "files" maps every other file's path (relative,
POSIX) to its sha256.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
GRAPH = "graph.onnx"
WEIGHTS = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
KERNELS_DIR = "kernels"


def hash_files(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` except the manifest, by relative POSIX path, sorted."""
    hashes = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            hashes[path.relative_to(root).as_posix()] = sha256_file(path)
    return hashes


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
