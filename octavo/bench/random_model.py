"""Random-weight Hugging Face model directories of real model shapes, with a generated tokenizer.

Speed does not depend on weight values, and correctness is checked against
Hugging Face on the same weights, so a benchmark or a GPU check needs no
downloaded checkpoint: `write_random_model("llama-3.1-8b", DIR)` writes what
`octavo compile DIR` and `AutoModelForCausalLM.from_pretrained(DIR)` read
(config.json, *.safetensors, generation_config.json, the tokenizer files).

The weights are drawn on `device` (a GPU fills an 8B model in well under a
second) from a seeded generator: every linear from N(0, 0.02), norms at 1,
and the embedding and lm_head from N(0, LOGIT_STD / sqrt(hidden)), so that the
logits of a unit-RMS final hidden state spread with a standard deviation of
about LOGIT_STD instead of crowding into near ties, which would make greedy
tokens depend on rounding alone.

The tokenizer (`write_tokenizer`) needs no download either: a byte-level BPE
whose vocabulary is the ChatML special tokens (ids 0-2, as SmolLM2 numbers
them), the 256 byte symbols (any text encodes) and filler tokens up to the
model's vocabulary size (each decodes to " t<id>"), with a ChatML chat
template.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from octavo.errors import OctavoError

LOGIT_STD = 4.0
LINEAR_STD = 0.02
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct): the bundled model's architecture.
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                         tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    # meta-llama/Llama-3.1-8B: 8.03e9 parameters.
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                         tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling=_LLAMA3_ROPE, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
}
"""Model shapes by name: the keyword arguments of their transformers config (model_type selects the class)."""


def random_config(shape: str | dict, **overrides):
    """The transformers config of a named shape (or of a dict of config fields), with `overrides` applied."""
    from transformers import AutoConfig

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise OctavoError(f"unknown model shape {shape!r}; choose one of {', '.join(sorted(SHAPES))}")
        shape = SHAPES[shape]
    fields = {**shape, **overrides}
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def parameter_count(config) -> int:
    """Parameters of a llama-style config (embedding, layers, final norm, lm_head unless tied)."""
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    attention = hidden * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    mlp = 3 * hidden * config.intermediate_size
    per_layer = attention + mlp + 2 * hidden
    lm_head = 0 if config.tie_word_embeddings else vocab * hidden
    return vocab * hidden + layers * per_layer + hidden + lm_head


@torch.no_grad()
def build_random_model(config, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                       seed: int = 0) -> torch.nn.Module:
    """The Hugging Face model of `config` on `device` in `dtype`, weights drawn as the module docstring says."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    vocab_std = LOGIT_STD / math.sqrt(config.hidden_size)
    for name, parameter in model.named_parameters():
        if "norm" in name:
            parameter.fill_(1.0)
        elif name.endswith("bias"):
            parameter.normal_(0.0, LINEAR_STD, generator=generator)
        elif "embed_tokens" in name or name.startswith("lm_head"):
            parameter.normal_(0.0, vocab_std, generator=generator)
        else:
            parameter.normal_(0.0, LINEAR_STD, generator=generator)
    return model.eval()


def write_random_model(shape: str | dict, directory: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                       device: str | torch.device = "cpu", seed: int = 0, **overrides) -> Path:
    """Write a random-weight model of `shape` (with config `overrides`) and a generated tokenizer to `directory`.

    Returns the directory: a Hugging Face model directory that Octavo compiles like any other.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = random_config(shape, **overrides)
    model = build_random_model(config, dtype, device, seed)
    # Shards of 4 GB: serializing one shard holds its bytes in host memory.
    model.save_pretrained(directory, max_shard_size="4GB")
    del model
    write_tokenizer(directory, config.vocab_size)
    return directory


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens with a ChatML chat template (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(SPECIAL_TOKENS) + len(alphabet):
        raise OctavoError(f"a generated tokenizer needs a vocabulary of at least "
                          f"{len(SPECIAL_TOKENS) + len(alphabet)} tokens, got {vocab_size}")
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    # Fillers: "Ġ" is the byte-level symbol of a space, so token i decodes to " t<i>".
    for index in range(len(vocab), vocab_size):
        vocab[f"Ġt{index}"] = index
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                        pad_token=PAD_TOKEN)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_tokenizer(directory: str | Path, vocab_size: int) -> Path:
    """Save build_tokenizer(vocab_size) as Hugging Face tokenizer files in `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size).save_pretrained(directory)
    return directory
