"""The artifact writer: one directory, written atomically (temp dir + rename).

Layout (octavo.ir.artifact_format; docs/architecture.md, "The artifact"):
manifest.json, graph.onnx, weights.safetensors, tokenizer/ (tokenizer files,
chat template, generation_config.json), kernels/.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.fx import GraphModule

from octavo.errors import ArtifactError
from octavo.ir.artifact_format import (
    FORMAT_VERSION,
    GRAPH,
    KERNELS_DIR,
    MANIFEST,
    TOKENIZER_DIR,
    WEIGHTS,
    hash_files,
    sha256_file,  # noqa: F401  (re-exported: callers of the writer hash with it)
)

logger = logging.getLogger(__name__)


def check_output_dir(output_dir: str | os.PathLike, overwrite: bool) -> Path:
    """Fail early (before any work) if the output exists and may not be replaced."""
    path = Path(output_dir).expanduser().resolve()
    if path.exists() and not overwrite:
        raise ArtifactError(f"{path} already exists; pass --overwrite to replace it")
    if path.exists() and not (path / MANIFEST).is_file():
        raise ArtifactError(f"{path} exists and is not an Octavo artifact; refusing to replace it")
    existing = path.parent  # missing directories above the artifact are made when it is written
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ArtifactError(f"cannot write {path}: {existing} is not a directory")
    return path


def write_artifact(output_dir: str | os.PathLike, *, graph_module: GraphModule, input_specs: dict,
                   weights: dict[str, torch.Tensor], manifest: dict, tokenizer, generation_config,
                   kernels: dict[str, str] | None = None, overwrite: bool = False) -> Path:
    """Write the artifact to a temp dir next to `output_dir`, then rename it into place.

    `manifest` gets format_version and the sha256 of every file added. An
    interrupted or failed write leaves no partial directory behind.
    """
    from octavo.ir.onnx_io import export_graph_to_onnx, save_onnx

    target = check_output_dir(output_dir, overwrite)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    except OSError as error:
        raise ArtifactError(f"cannot write {target}: {error.strerror or error}") from None
    try:
        save_onnx(export_graph_to_onnx(graph_module, input_specs, graph_name=manifest["source"]["name"]),
                  staging / GRAPH)
        save_file({name: tensor.contiguous() for name, tensor in weights.items()}, staging / WEIGHTS)
        _write_tokenizer(staging / TOKENIZER_DIR, tokenizer, generation_config)
        _write_kernels(staging / KERNELS_DIR, kernels or {})
        manifest = {"format_version": FORMAT_VERSION, **manifest, "files": hash_files(staging)}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        _make_readable(staging)
        _replace_directory(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote artifact %s", target)
    return target


def _write_tokenizer(directory: Path, tokenizer, generation_config) -> None:
    directory.mkdir()
    tokenizer.save_pretrained(directory)
    generation_config.save_pretrained(directory)


def _write_kernels(directory: Path, kernels: dict[str, str]) -> None:
    directory.mkdir()
    for name, source in sorted(kernels.items()):
        (directory / name).write_text(source)


def _make_readable(root: Path) -> None:
    """mkdtemp creates the staging dir private; give the artifact the usual umask-derived modes."""
    umask = _current_umask()
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _current_umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask both sets and reads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _replace_directory(staging: Path, target: Path) -> None:
    if not target.exists():
        os.rename(staging, target)
        return
    retired = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.rename(target, retired)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(retired, target)  # put the old artifact back: a failed overwrite changes nothing
        raise
    shutil.rmtree(retired, ignore_errors=True)
