"""Fixtures of the server tests: one tiny-model server shared by the tests of this package."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.serve.server_process import running_server

TINY_MAX_MODEL_LEN = 128
TINY_NUM_KV_BLOCKS = 1024


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """The servers run with --threads 1 (see server_process), and so do the in-process references:
    the same thread count on both sides, and no oversubscription of a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="package")
def tiny_llama_artifact(tiny_artifact):
    return tiny_artifact("llama")


@pytest.fixture(scope="package")
def tiny_llama_variant(tiny_model_dir, tmp_path_factory) -> Callable[[str, Callable[[Path], None]], Path]:
    """Factory: the tiny llama compiled (float32) after `edit(source_dir)` changed its files (its tokenizer, its
    chat template), for the tests that need a tokenizer unlike the bundled model's."""
    from octavo.compiler import compile_model
    from octavo.config import CompileConfig

    def build(name: str, edit: Callable[[Path], None]) -> Path:
        source = tmp_path_factory.mktemp(f"tiny-{name}") / "model"
        shutil.copytree(tiny_model_dir("llama"), source)
        edit(source)
        output = tmp_path_factory.mktemp(f"artifact-{name}") / "artifact"
        return compile_model(source, output, CompileConfig(dtype="float32"))

    return build


def artifact_tokenizer(artifact: Path):
    """The Hugging Face tokenizer an artifact ships (the reference its prompts are checked against)."""
    from transformers import AutoTokenizer

    from octavo.ir.artifact_format import TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(artifact / TOKENIZER_DIR, local_files_only=True)


@pytest.fixture(scope="package")
def tiny_server(tiny_llama_artifact, tmp_path_factory):
    """`octavo serve` of the tiny llama (real tokenizer), without API key or queue limit.

    It is stopped with SIGINT (what Ctrl-C sends) and must exit 0.
    """
    with running_server(tiny_llama_artifact, tmp_path_factory.mktemp("serve-tiny"),
                        "--num-kv-blocks", str(TINY_NUM_KV_BLOCKS), "--max-model-len", str(TINY_MAX_MODEL_LEN),
                        stop_signal=signal.SIGINT) as server:
        yield server


@pytest.fixture(scope="package")
def tiny_offline(tiny_llama_artifact):
    """The same artifact in-process through LLM, the reference the server's outputs must equal."""
    from octavo.llm import LLM

    return LLM(tiny_llama_artifact, num_kv_blocks=TINY_NUM_KV_BLOCKS, max_model_len=TINY_MAX_MODEL_LEN)
