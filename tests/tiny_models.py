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
TINY_WINDOW = 24  # the sliding window of the tiny configs that have one, shorter than the test sequences
# Soft caps small enough that tanh bends the tiny models' scores and logits (a cap far above them would be a no-op).
TINY_ATTENTION_SOFT_CAP = 1.0
TINY_FINAL_SOFT_CAP = 4.0
# Rope scalings whose original context is shorter than the test sequences, so the scaled frequencies matter.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 32}
PHI3_ORIGINAL_CONTEXT = 256


def tiny_config(model_type: str, **overrides):
    """The tiny config of `model_type`; `overrides` replace entries of COMMON (head counts, sizes)."""
    common = {**COMMON, **overrides}
    builder = _BUILDERS.get(model_type)
    if builder is None:
        raise ValueError(model_type)
    return builder(common)


def _llama(common):
    from transformers import LlamaConfig
    # Llama 3.1+ configs scale their rope this way.
    return LlamaConfig(**common, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)


def _mistral(common):
    from transformers import MistralConfig
    return MistralConfig(**common, sliding_window=TINY_WINDOW, tie_word_embeddings=False)


def _qwen2(common):
    from transformers import Qwen2Config
    # YaRN, as Qwen2.5's long-context configs set it.
    return Qwen2Config(**common, rope_parameters=dict(YARN_ROPE), tie_word_embeddings=True)


def _qwen3(common):
    from transformers import Qwen3Config
    return Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)


def _gemma2(common):
    from transformers import Gemma2Config
    # Gemma 2 alternates sliding and global layers (sliding first) and soft-caps scores and logits.
    return Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=TINY_WINDOW,
                        attn_logit_softcapping=TINY_ATTENTION_SOFT_CAP, final_logit_softcapping=TINY_FINAL_SOFT_CAP,
                        pad_token_id=0, tie_word_embeddings=True)


def _gemma3(common):
    from transformers import Gemma3TextConfig
    # Local layers with their own rope base, a global layer with a linearly scaled one (as Gemma 3 4B+).
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
    return Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=TINY_WINDOW,
                            layer_types=["sliding_attention", "full_attention"], rope_parameters=rope,
                            pad_token_id=0, tie_word_embeddings=True)


def _phi3(common):
    from transformers import Phi3Config
    # Phi-4-mini's form: a quarter of each head unrotated, longrope factors, tied embeddings.
    rotary_half = int(16 * 0.75) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.25 * i for i in range(rotary_half)],
            "long_factor": [2.0 + 0.5 * i for i in range(rotary_half)],
            "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT}
    return Phi3Config(**common, partial_rotary_factor=0.75, rope_parameters=rope, sliding_window=None,
                      original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT, pad_token_id=0,
                      tie_word_embeddings=True)


def _olmo2(common):
    from transformers import Olmo2Config
    return Olmo2Config(**common, pad_token_id=0, tie_word_embeddings=False)


# Mixtures of experts: 4 experts of intermediate size 32, 2 per token.
TINY_EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _qwen3_moe(common):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**common, **TINY_EXPERTS, head_dim=16, num_experts=4, norm_topk_prob=True,
                          tie_word_embeddings=False)


def _qwen2_moe(common):
    from transformers import Qwen2MoeConfig
    # Qwen1.5/2-MoE: unnormalized top-k weights and a shared expert behind a sigmoid gate.
    return Qwen2MoeConfig(**common, **TINY_EXPERTS, num_experts=4, norm_topk_prob=False,
                          shared_expert_intermediate_size=64, tie_word_embeddings=False)


def _mixtral(common):
    from transformers import MixtralConfig
    return MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
                         sliding_window=None, tie_word_embeddings=False)


def _olmoe(common):
    from transformers import OlmoeConfig
    return OlmoeConfig(**{**common, "intermediate_size": 32}, num_experts=4, num_experts_per_tok=2,
                       norm_topk_prob=False, pad_token_id=0, tie_word_embeddings=False)


_BUILDERS = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
}
TINY_MODELS = tuple(_BUILDERS)
"""Every model_type the tests build a tiny model of."""
NEW_DENSE_FAMILIES = ("gemma2", "gemma3_text", "phi3", "olmo2")
"""The dense families whose numerics differ from Llama's (norm order, soft-caps, partial rotary, longrope)."""
MIXTURES_OF_EXPERTS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


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
