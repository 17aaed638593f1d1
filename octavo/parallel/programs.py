"""A rank's program: the artifact sharded for one rank position by the parallel passes, at load time."""

from __future__ import annotations

from pathlib import Path

from octavo.config import RankPosition
from octavo.ir.artifact_format import GRAPH, WEIGHTS
from octavo.passes.rank_program import RankProgram, prepare_rank_program
from octavo.runtime.loader import LoadedArtifact


def program_of(artifact: LoadedArtifact, position: RankPosition) -> RankProgram:
    """The program of `position` from an artifact this process loaded (rank 0's engine)."""
    return prepare_rank_program(artifact.graph_module, artifact.weights, artifact.manifest, position)


def load_program(root: Path, position: RankPosition, verify: bool) -> tuple[dict, RankProgram]:
    """The manifest and the program of `position`, read from the artifact at `root` (a worker needs no tokenizer).

    `verify` checks every file's checksum (rank 0 did when its worker ranks share its file system).
    """
    from octavo.ir.onnx_io import import_graph_from_onnx
    from octavo.runtime.loader import read_manifest, verify_files
    from octavo.runtime.weights import load_safetensors_mmap

    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest)
    graph_module = import_graph_from_onnx(root / GRAPH)
    weights = load_safetensors_mmap(root / WEIGHTS)
    return manifest, prepare_rank_program(graph_module, weights, manifest, position)
