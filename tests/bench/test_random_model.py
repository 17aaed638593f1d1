"""Random-weight model directories of real shapes with a generated tokenizer: what Octavo and HF both load."""

from __future__ import annotations

import json

import pytest
import torch

from octavo.bench.random_model import (
    CHAT_TEMPLATE,
    LOGIT_STD,
    SPECIAL_TOKENS,
    build_random_model,
    build_tokenizer,
    parameter_count,
    random_config,
    write_random_model,
)
from octavo.errors import OctavoError

# A one-layer SmolLM2-shaped model: the shape's vocabulary, tying and rope, small elsewhere.
SMALL = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def test_parameter_counts_are_the_published_ones():
    # Llama-3.1-8B has 8,030,261,248 parameters; SmolLM2-135M 134,515,008.
    assert parameter_count(random_config("llama-3.1-8b")) == 8_030_261_248
    assert parameter_count(random_config("smollm2-135m")) == 134_515_008
    config = random_config("llama-3.1-8b")
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (32, 4096, 32, 8, 14336, 128256)
    assert config.rope_scaling["rope_type"] == "llama3"
    with pytest.raises(OctavoError, match="unknown model shape 'gpt-9'"):
        random_config("gpt-9")


def test_generated_tokenizer_encodes_any_text_and_renders_chatml():
    tokenizer = build_tokenizer(49152)
    assert len(tokenizer) == 49152
    assert [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS] == [0, 1, 2]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 0)
    text = "Grüße, world!\n\tdef f(x): return x ** 2  # ünïcode ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode([49151, 300]) == " t49151 t300"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(prompt)
    assert ids[0] == 1 and ids.count(2) == 1
    with pytest.raises(OctavoError, match="at least 259 tokens"):
        build_tokenizer(100)


def test_weights_are_seeded_and_spread_the_logits():
    config = random_config("smollm2-135m", **SMALL)
    first, second = (build_random_model(config, torch.float32, seed=3) for _ in range(2))
    other = build_random_model(config, torch.float32, seed=4)
    weights = dict(first.named_parameters())
    assert all(torch.equal(weights[name], parameter) for name, parameter in second.named_parameters())
    assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"],
                           dict(other.named_parameters())["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    with torch.no_grad():
        logits = first(torch.randint(3, 49152, (1, 24), generator=torch.Generator().manual_seed(0))).logits
    # A unit-RMS final hidden state times rows of N(0, LOGIT_STD^2 / hidden): logits of about LOGIT_STD.
    assert 0.5 * LOGIT_STD < float(logits.std()) < 2 * LOGIT_STD


def test_written_directory_loads_in_octavo_and_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    from octavo.frontend import load_model

    directory = write_random_model("smollm2-135m", tmp_path / "model", dtype=torch.float32, seed=5, **SMALL)
    source = load_model(directory)
    assert source.config.tie_word_embeddings and source.config.vocab_size == 49152
    assert source.tokenizer.chat_template == CHAT_TEMPLATE and len(source.tokenizer) == 49152
    assert json.loads((directory / "config.json").read_text())["num_hidden_layers"] == 1
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    built = build_random_model(random_config("smollm2-135m", **SMALL), torch.float32, seed=5)
    expected = dict(built.named_parameters())
    assert all(torch.equal(expected[name], parameter) for name, parameter in loaded.named_parameters())
