"""Artifact loading: verify the manifest and checksums, rebuild the graph from graph.onnx, map the weights.

Loading never executes code from the artifact: no pickle, no import of kernels/.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.fx import GraphModule

from octavo.codegen.triton_backend.sources import check_kernel_sources
from octavo.errors import ArtifactError
from octavo.ir.artifact_format import FORMAT_VERSION, GRAPH, MANIFEST, TOKENIZER_DIR, WEIGHTS, sha256_file
from octavo.runtime.weights import load_safetensors_mmap

logger = logging.getLogger(__name__)


@dataclass
class LoadedArtifact:
    path: Path
    manifest: dict
    graph_module: GraphModule
    weights: dict[str, torch.Tensor]
    tokenizer: object
    generation_config: object
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def kv_layout(self) -> dict:
        return self.manifest["kv_layout"]

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.manifest.get("eos_token_ids", []))


def read_manifest(path: str | os.PathLike) -> dict:
    """manifest.json of the artifact at `path`, after the format-version check."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ArtifactError(f"no such artifact directory: {root}")
    if not (root / MANIFEST).is_file():
        raise ArtifactError(f"{root} is not an Octavo artifact (no {MANIFEST}); create one with `octavo compile`")
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except ValueError as error:
        raise ArtifactError(f"{root / MANIFEST} is not valid JSON: {error}") from error
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"artifact {root} has format version {version}; this Octavo reads version "
                            f"{FORMAT_VERSION}: recompile it with `octavo compile`")
    return manifest


def verify_files(root: Path, manifest: dict) -> None:
    """Every file the manifest lists exists and has the recorded sha256."""
    for relative, expected in manifest.get("files", {}).items():
        file = root / relative
        if not file.is_file():
            raise ArtifactError(f"artifact {root} is missing {relative}")
        if sha256_file(file) != expected:
            raise ArtifactError(f"checksum mismatch for {file}: the file is corrupted or was modified; "
                                "recompile the artifact")
    for required in (GRAPH, WEIGHTS):
        if required not in manifest.get("files", {}):
            raise ArtifactError(f"artifact {root}: the manifest does not list {required}")


def load_artifact(path: str | os.PathLike, verify: bool = True) -> LoadedArtifact:
    """Load an artifact directory (see the module docstring)."""
    from transformers import AutoTokenizer, GenerationConfig

    from octavo.ir.onnx_io import import_graph_from_onnx

    root = Path(path).expanduser().resolve()
    timings = {}
    start = time.perf_counter()
    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest)
    timings["verify_s"] = time.perf_counter() - start
    start = time.perf_counter()
    graph_module = import_graph_from_onnx(root / GRAPH)
    # Kernels are regenerated from the graph, never imported from kernels/; a hash mismatch is only reported.
    check_kernel_sources(graph_module, manifest)
    timings["graph_s"] = time.perf_counter() - start
    start = time.perf_counter()
    weights = load_safetensors_mmap(root / WEIGHTS)
    timings["weights_s"] = time.perf_counter() - start
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(root / TOKENIZER_DIR, local_files_only=True)
    generation_config = GenerationConfig.from_pretrained(root / TOKENIZER_DIR, local_files_only=True)
    timings["tokenizer_s"] = time.perf_counter() - start
    logger.info("loaded artifact %s (%s)", root, ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
    return LoadedArtifact(root, manifest, graph_module, weights, tokenizer, generation_config, timings)
