"""A tiny llama with a 16-token vocabulary and a matching whitespace tokenizer (w0 .. w12).

Sampling distributions over a small vocabulary can be checked with few samples, and its
output layer is so small that thousands of samples take seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL = ["<unk>", "<s>", "</s>"]
WORDS = [f"w{index}" for index in range(13)]
VOCAB_SIZE = len(SPECIAL) + len(WORDS)
EOS_ID = 2


def write_small_vocab_model(directory: Path, seed: int) -> Path:
    """Save the model (random weights from `seed`) and its tokenizer to `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocabulary = {token: index for index, token in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()  # joins the words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=EOS_ID, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.8, 1.2)
            else:
                parameter.normal_(0.0, 0.3)  # logits spread over a few tokens, not one
    model.eval().save_pretrained(directory)
    return directory
