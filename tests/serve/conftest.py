"""Fixtures of the server tests: one tiny-model server shared by the tests of this package."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.serve.server_process import running_server
from tests.shared_builds import built_once

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
def tiny_llama_variant(tiny_model_dir) -> Callable[[str, Callable[[Path], None]], Path]:
    """Factory: the tiny llama compiled (float32) after `edit(source_dir)` changed its files (its tokenizer, its
    chat template), for the tests that need a tokenizer unlike the bundled model's. `name` names the edit: each
    variant is built once per run (tests/shared_builds.py)."""
    from octavo.compiler import compile_model
    from octavo.config import CompileConfig

    def make(edit: Callable[[Path], None], directory: Path) -> Path:
        source = directory / "model"
        shutil.copytree(tiny_model_dir("llama"), source)
        edit(source)
        return compile_model(source, directory / "artifact", CompileConfig(dtype="float32"))

    def build(name: str, edit: Callable[[Path], None]) -> Path:
        return built_once(f"artifact-llama-{name}", partial(make, edit))

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


TOOL_TEMPLATE = (
    "{%- if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{%- if tools %}<|im_start|>system\nYou can call these functions:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "<tool_call>{{ {'id': call.id, 'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "</tool_call>{%- endfor %}"
    "{%- if message.tool_call_id %} [result of {{ message.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A chat template that renders tools and tool conversations (the bundled model's template ignores both),
writing calls in the hermes format (<tool_call>), so the server reads replies with the hermes parser."""


@pytest.fixture(scope="package")
def tool_artifact(tiny_llama_variant):
    """The tiny llama with TOOL_TEMPLATE as its chat template."""
    from transformers import AutoTokenizer

    def with_tool_template(source):
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        tokenizer.chat_template = TOOL_TEMPLATE
        tokenizer.save_pretrained(source)

    return tiny_llama_variant("tools", with_tool_template)


@pytest.fixture(scope="package")
def tool_server(tool_artifact, tmp_path_factory):
    """`octavo serve` of the tool-template artifact, shared by the tool tests (512 tokens: tools make long prompts)."""
    with running_server(tool_artifact, tmp_path_factory.mktemp("serve-tools"), "--num-kv-blocks", "128",
                        "--max-model-len", "512") as server:
        yield server
