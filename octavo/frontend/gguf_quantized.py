"""GGUF tensors kept quantized: Q8_0, Q4_0 and Q4_1 blocks -> Octavo's w8 / w4 layouts, bit for bit.

transformers' GGUF loader dequantizes every tensor to float; this module reads the same
file's quantized blocks instead and rewrites them, without any float arithmetic, into the
portable layouts of octavo.ir.quantized_layout (group size 32, float16 scales):

- Q8_0 (block: float16 d, 32 int8 q; value d * q) -> w8: qweight = q, scales = d.
- Q4_1 (block: float16 d, float16 m, 16 bytes; value d * q + m) -> w4: scales = d, offsets = m.
- Q4_0 (block: float16 d, 16 bytes; value d * (q - 8)) -> w4: scales = d, offsets = -8 d
  (exact in float16: a power-of-two multiple).

In a GGUF block byte j holds element j in its low nibble and element j + 16 in its high
nibble; the nibbles are reordered into Octavo's packing (even column low, odd column high).
Dequantizing the result computes exactly GGUF's own float32 formula (see
quantized_layout), so the values equal transformers' float weights bit for bit (for Q4_0
the value zero may come out as +0 where GGUF's ``d * (q - 8)`` gives -0: equal values).

Names and row order follow transformers' loader: the GGUF -> HF name map and its tensor
processor, whose row permutations (llama's q/k head interleaving) are applied to the
quantized rows too. A tensor whose processing is not a pure row reordering, and tensors
of other GGUF types, are left to the float path (logged).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from octavo.ir.quantized_layout import W4, W8, QuantizedWeight, pack_int4

logger = logging.getLogger(__name__)

BLOCK = 32
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def gguf_quantized_weights(path, config, reader=None) -> dict[str, QuantizedWeight]:
    """HF parameter name -> QuantizedWeight for every Q8_0 / Q4_0 / Q4_1 tensor of the GGUF at `path`.

    `config` is the model's transformers config (it names the heads the row permutation needs);
    `reader`, a gguf.GGUFReader of the file when the caller has one (parsing a file's metadata
    takes seconds).
    """
    import gguf

    reader = reader or gguf.GGUFReader(path)
    processor, name_map = _transformers_naming(reader, config)
    weights: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in _CONVERTERS:
            if kind not in _FLOAT_TYPES:
                logger.info("GGUF tensor %s is %s, which has no Octavo layout: dequantized to float",
                            tensor.name, kind)
            continue
        rows = _row_order(processor, name_map, tensor.name, int(tensor.data.shape[0]))
        hf_name = name_map.get(tensor.name)
        if hf_name is None or rows is None:
            logger.info("GGUF tensor %s (%s): transformers changes it beyond a row reordering: dequantized",
                        tensor.name, kind)
            continue
        blocks = torch.from_numpy(np.array(tensor.data, copy=True)).view(torch.uint8)
        quantized = _CONVERTERS[kind](blocks)
        weights[hf_name] = quantized if rows is _IDENTITY else quantized.take_rows(rows)
    return weights


def q8_0_to_w8(data: torch.Tensor) -> QuantizedWeight:
    """uint8 [rows, blocks * 34] of Q8_0 blocks -> w8 with group size 32."""
    blocks = data.reshape(data.shape[0], -1, 2 + BLOCK)
    scales = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1)
    qweight = blocks[..., 2:].contiguous().view(torch.int8).reshape(data.shape[0], -1)
    return QuantizedWeight(W8, qweight, scales.contiguous(), None, BLOCK, "gguf Q8_0")


def q4_1_to_w4(data: torch.Tensor) -> QuantizedWeight:
    """uint8 [rows, blocks * 20] of Q4_1 blocks -> w4 with group size 32."""
    blocks = data.reshape(data.shape[0], -1, 4 + BLOCK // 2)
    scales = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    offsets = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
    qweight = _repack_nibbles(blocks[..., 4:])
    return QuantizedWeight(W4, qweight, scales.contiguous(), offsets.contiguous(), BLOCK, "gguf Q4_1")


def q4_0_to_w4(data: torch.Tensor) -> QuantizedWeight:
    """uint8 [rows, blocks * 18] of Q4_0 blocks -> w4 with group size 32 (offset -8 d)."""
    blocks = data.reshape(data.shape[0], -1, 2 + BLOCK // 2)
    scales = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    offsets = scales * -8.0  # a power-of-two multiple: exact in float16 (GGUF scales are far below overflow)
    qweight = _repack_nibbles(blocks[..., 2:])
    return QuantizedWeight(W4, qweight, scales.contiguous(), offsets.contiguous(), BLOCK, "gguf Q4_0")


def _repack_nibbles(quants: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 16] GGUF nibble bytes -> Octavo's w4 packing [rows, blocks * 16]."""
    low, high = quants & 0x0F, quants >> 4
    values = torch.cat([low, high], dim=-1)  # block element j is low nibble j (j < 16), else high nibble j - 16
    return pack_int4(values.reshape(quants.shape[0], -1))


_CONVERTERS = {"Q8_0": q8_0_to_w8, "Q4_0": q4_0_to_w4, "Q4_1": q4_1_to_w4}
_IDENTITY = object()


def _transformers_naming(reader, config):
    """transformers' tensor processor for this file and the GGUF -> HF parameter name map it uses.

    The map is built as transformers' get_gguf_hf_weights_map builds it at the model's top
    level (gguf's tensor name map over the HF state-dict names), without its per-submodule
    recursion, which rebuilds gguf's name table for every module and adds nothing for the
    architectures Octavo supports.
    """
    import gguf
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    table = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    with torch.device("meta"):
        names = list(AutoModelForCausalLM.from_config(config).state_dict())
    name_map = {}
    for hf_name in names:
        base, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        gguf_name = table.get_name(base) if suffix in ("weight", "bias") else None
        if gguf_name is not None:
            name_map[f"{gguf_name}{dot}{suffix}"] = hf_name
    return processor, name_map


def _row_order(processor, name_map: dict, name: str, rows: int):
    """The row permutation transformers applies to tensor `name` (_IDENTITY when none), or None."""
    index = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    try:
        result = processor.process(weights=index, name=name, tensor_key_mapping=name_map,
                                   parsed_parameters={"config": processor.config, "tensors": {}})
    except Exception:  # a processor that needs more than a row reordering
        return None
    if result.name != name or result.weights.shape != index.shape:
        return None
    order = result.weights.reshape(-1)
    if not np.array_equal(np.sort(order), index.reshape(-1)):
        return None
    if np.array_equal(order, index.reshape(-1)):
        return _IDENTITY
    return torch.from_numpy(order.astype(np.int64))
