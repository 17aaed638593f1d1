"""The compile cache: artifacts under ~/.cache/octavo keyed by everything that decides their output."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

import torch

from octavo.cache_dir import cache_root
from octavo.codegen.cpu_backend.precision import resolve_precision
from octavo.config import CompileConfig
from octavo.frontend.sources import ModelSource, load_model
from octavo.ir.artifact_format import MANIFEST
from octavo.version import __version__

logger = logging.getLogger(__name__)


def cache_key(model_source: ModelSource, config: CompileConfig) -> str:
    """The first 16 hex digits of sha256 over ``json.dumps(payload, sort_keys=True)``, where payload is
    ``{"model": model checksum, "options": config.output_key(), "octavo": version, "torch": version,
    "transformers": version}``: everything that decides the artifact's contents, nothing else."""
    import transformers

    payload = {
        "model": model_source.checksum,
        "options": resolve_precision(config).output_key(),
        "octavo": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def cached_artifact(source: str | os.PathLike, config: CompileConfig | None = None,
                    on_stage=None) -> Path:
    """The artifact for (source, config), compiled into the cache unless an identical one is there."""
    from octavo.compiler import compile_model

    config = resolve_precision(config or CompileConfig())
    model_source = load_model(source)
    key = cache_key(model_source, config)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", model_source.name.removesuffix(".gguf"))
    weights = "" if config.storage_dtype == config.dtype else f"-w{config.storage_dtype}"
    path = cache_root() / f"{name}-{config.dtype}{weights}-{key}"
    if (path / MANIFEST).is_file():
        logger.info("using cached artifact %s", path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    logger.info("compiling %s into the cache at %s", model_source.name, path)
    compile_model(model_source, path, config, overwrite=path.exists(), on_stage=on_stage)
    return path
