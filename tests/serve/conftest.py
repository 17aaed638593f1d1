"""Fixtures of the server tests: one tiny-model server shared by the tests of this package."""

from __future__ import annotations

import signal

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
