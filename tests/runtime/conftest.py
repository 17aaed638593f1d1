"""Fixtures of the engine tests: the tiny llama artifact, loaded once per module, and its HF reference."""

from __future__ import annotations

import pytest
import torch

from octavo.runtime.loader import load_artifact


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    """The tiny llama artifact, loaded once: engines share the loaded graph and weights, each has its own cache."""
    return load_artifact(tiny_artifact("llama"))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    """Hugging Face's own tiny llama (fp32, eager attention), the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()
