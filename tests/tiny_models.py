"""Tiny random-weight configs of every supported architecture (2 layers, GQA 4/2)."""

from __future__ import annotations

import torch

VOCAB_SIZE = 49152  # the bundled tokenizer's vocabulary, so tiny models use the real tokenizer
COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY_WINDOW = 24  # mistral's sliding window in the tiny config, shorter than the test sequences


def tiny_config(model_type: str, **overrides):
    """The tiny config of `model_type`; `overrides` replace entries of COMMON (head counts, sizes)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = {**COMMON, **overrides}
    if model_type == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if model_type == "mistral":
        return MistralConfig(**common, sliding_window=TINY_WINDOW, tie_word_embeddings=False)
    if model_type == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if model_type == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    raise ValueError(model_type)


def make_tiny_model(model_type: str, seed: int = 0, **overrides):
    """A random-weight model whose logits are not flat (weights scaled up so tokens differ)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.08)
            else:
                parameter.uniform_(0.8, 1.2)
    return model.eval()
