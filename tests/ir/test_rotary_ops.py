"""octavo.rotary_embedding against transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import octavo.ir  # registers the ops

octavo = torch.ops.octavo
MAX_POSITIONS = 300


def rotary_module(head_dim: int, rope_parameters: dict | None = None) -> LlamaRotaryEmbedding:
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=MAX_POSITIONS,
                         rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    return LlamaRotaryEmbedding(config)


def cos_sin_cache(rotary: LlamaRotaryEmbedding, dtype: torch.dtype) -> torch.Tensor:
    """HF's cos and sin for every position, as [positions, 2, head_dim] (what fuse_rope stores)."""
    probe = torch.empty(0, dtype=dtype)
    cos, sin = rotary(probe, torch.arange(MAX_POSITIONS).unsqueeze(0))
    return torch.stack([cos[0], sin[0]], dim=1)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope_parameters", [None, YARN], ids=["default", "yarn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (3, 1, 128), (2, 2, 16)])
def test_rotary_embedding_equals_hf_bitwise(num_heads, num_kv_heads, head_dim, dtype, rope_parameters):
    rotary = rotary_module(head_dim, rope_parameters)
    positions = torch.tensor([5, 6, 7, 0, 299, 1, 2, 150])  # several sequences, out of order
    tokens = len(positions)
    # The layout HF applies RoPE in: [1, heads, T, D], a transpose of the projection's [1, T, heads, D].
    query = torch.randn(1, tokens, num_heads, head_dim).to(dtype).transpose(1, 2)
    key = torch.randn(1, tokens, num_kv_heads, head_dim).to(dtype).transpose(1, 2)
    cos, sin = rotary(query, positions.unsqueeze(0))
    expected_query, expected_key = apply_rotary_pos_emb(query, key, cos, sin)
    result_query, result_key = octavo.rotary_embedding(query, key, positions, cos_sin_cache(rotary, dtype))
    assert result_query.dtype == dtype and result_key.dtype == dtype
    assert torch.equal(result_query, expected_query)
    assert torch.equal(result_key, expected_key)


def test_single_token_decode():
    rotary = rotary_module(64)
    query, key = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 1, 64)
    positions = torch.tensor([123])
    cos, sin = rotary(query, positions.unsqueeze(0))
    expected = apply_rotary_pos_emb(query, key, cos, sin)
    result = octavo.rotary_embedding(query, key, positions, cos_sin_cache(rotary, torch.float32))
    assert all(torch.equal(a, b) for a, b in zip(result, expected, strict=True))


def test_fake_impl_gives_the_real_shapes_and_dtypes():
    query, key = torch.randn(1, 4, 5, 16).to(torch.bfloat16), torch.randn(1, 2, 5, 16).to(torch.bfloat16)
    cache, positions = torch.randn(10, 2, 16).to(torch.bfloat16), torch.arange(5)
    real = octavo.rotary_embedding(query, key, positions, cache)
    with FakeTensorMode() as mode:
        fake = octavo.rotary_embedding(*(mode.from_tensor(t) for t in (query, key, positions, cache)))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


def test_schema_follows_the_op_contract():
    assert str(octavo.rotary_embedding.default._schema) == (
        "octavo::rotary_embedding(Tensor query, Tensor key, Tensor positions, Tensor cos_sin_cache) "
        "-> (Tensor, Tensor)")
