"""GGUF Q8_0 / Q4_0 / Q4_1 tensors kept quantized: Octavo's layouts dequantize to gguf's own values, bit for bit."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from octavo.frontend.gguf_quantized import gguf_quantized_weights, q4_0_to_w4, q4_1_to_w4, q8_0_to_w8

CONVERTERS = {"Q8_0": q8_0_to_w8, "Q4_0": q4_0_to_w4, "Q4_1": q4_1_to_w4}
Q = gguf.GGMLQuantizationType


def same_bits(actual: torch.Tensor, expected: np.ndarray) -> bool:
    return torch.equal(actual.view(torch.int32), torch.from_numpy(np.ascontiguousarray(expected, np.float32))
                       .view(torch.int32))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_convert_exactly(kind):
    rng = np.random.default_rng(0)
    # Rows of 96: three blocks each; values of both signs, one all-zero row, one constant row.
    values = (rng.standard_normal((6, 96)) * rng.uniform(0.01, 2.0, (6, 1))).astype(np.float32)
    values[1] = 0.0
    values[4] = 0.37
    blocks = gguf.quants.quantize(values, Q[kind])
    weight = CONVERTERS[kind](torch.from_numpy(blocks))
    assert (weight.group_size, weight.in_features, weight.out_features) == (32, 96, 6)
    assert weight.scales.dtype == torch.float16
    expected = gguf.quants.dequantize(blocks, Q[kind])
    if kind == "Q4_0":
        # Equal values; only zero's sign can differ: GGUF's d * (q - 8) gives -0 for a negative d where
        # q * d + (-8 d) gives +0 (a sum of opposites rounds to +0).
        assert torch.equal(weight.dequantize(), torch.from_numpy(expected))
        assert same_bits(weight.dequantize()[weight.dequantize() != 0], expected[expected != 0])
    else:
        assert same_bits(weight.dequantize(), expected)


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_source):
    return gguf.GGUFReader(smollm2_source.path)


@pytest.fixture(scope="module")
def smollm2_gguf_weights(smollm2_source, smollm2_reader):
    return gguf_quantized_weights(smollm2_source.path, smollm2_source.config, smollm2_reader)


def test_every_q4_1_and_q8_0_tensor_of_smollm2_is_kept(smollm2_gguf_weights):
    origins = [weight.origin for weight in smollm2_gguf_weights.values()]
    assert origins.count("gguf Q4_1") == 7 * 30 and origins.count("gguf Q8_0") == 1
    assert smollm2_gguf_weights["model.embed_tokens.weight"].layout == "w8"


@pytest.mark.parametrize(("gguf_name", "hf_name", "heads"), [
    ("token_embd.weight", "model.embed_tokens.weight", None),
    ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
    ("blk.7.attn_v.weight", "model.layers.7.self_attn.v_proj.weight", None),
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 9),   # rows interleaved by llama.cpp
    ("blk.29.attn_k.weight", "model.layers.29.self_attn.k_proj.weight", 3),
])
def test_smollm2_tensors_equal_gguf_dequantization(smollm2_reader, smollm2_gguf_weights, gguf_name, hf_name, heads):
    tensor = next(t for t in smollm2_reader.tensors if t.name == gguf_name)
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if heads:  # undo llama.cpp's q/k row permutation, as transformers' loader does
        expected = expected.reshape(heads, -1, 2, expected.shape[1]).swapaxes(1, 2).reshape(expected.shape)
    assert same_bits(smollm2_gguf_weights[hf_name].dequantize(), expected)


def test_other_types_are_left_to_the_float_path_with_a_log_line(tmp_path, caplog):
    path = tmp_path / "tiny.gguf"
    rng = np.random.default_rng(1)
    query = rng.standard_normal((64, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(rng.standard_normal((50, 64)).astype(np.float32),
                                                                Q.Q5_0), raw_dtype=Q.Q5_0)
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(query, Q.Q4_0), raw_dtype=Q.Q4_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    with caplog.at_level(logging.INFO, logger="octavo.frontend.gguf_quantized"):
        weights = gguf_quantized_weights(path, config)
    assert set(weights) == {"model.layers.0.self_attn.q_proj.weight"}
    assert "token_embd.weight is Q5_0, which has no Octavo layout: dequantized to float" in caplog.text
    expected = gguf.quants.dequantize(gguf.quants.quantize(query, Q.Q4_0), Q.Q4_0)
    expected = expected.reshape(4, -1, 2, 64).swapaxes(1, 2).reshape(64, 64)
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"].dequantize(), torch.from_numpy(expected))
