"""End to end: a bfloat16 model with an int8 KV cache on the default engine (cpu backend, compiled executor).

A tiny Llama with 32-dim heads (the integer decode path takes whole 32-value parts) in bfloat16 with
`--kv-cache-dtype int8`, run twice on the compiled executor: as users get it (the decode attention multiplies
int16 pairs where the build has them: AVX-512, where the logits then differ from widening's somewhere) and with
OCTAVO_CPU_INT8_CACHE_DOT=float (every row widened to float32; builds below AVX-512 always widen). Both read the
same int8 cache; they differ only in how the attention rounds: tests/codegen/cpu/engine_pairs.py states what must
agree.
"""

from __future__ import annotations

import pytest
import torch

from octavo.codegen.cpu_backend.isa import cpu_target
from octavo.config import CompileConfig
from tests.codegen.cpu.engine_pairs import (
    default_engine_pair,
    largest_logit_difference,
    random_prompts,
    reference_models,
    tiny_llama_d32,
)

PROMPT_LENGTHS = [6, 23, 40]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    return tiny_llama_d32(tmp_path_factory.mktemp("tiny-llama-d32"), tokenizer_dir)


def test_default_engine_decodes_an_int8_cache_as_the_widening_path_does(model_dir, tmp_path, cpu_kernels, one_thread,
                                                                       compiled_cache, monkeypatch):
    default, widening = default_engine_pair(model_dir, tmp_path / "artifact",
                                            CompileConfig(dtype="bfloat16", kv_cache_dtype="int8"),
                                            "OCTAVO_CPU_INT8_CACHE_DOT", monkeypatch)
    assert default.kv_cache.tensors[next(iter(default.kv_cache.tensors))].dtype == torch.int8

    models = reference_models(model_dir)
    prompts = random_prompts(PROMPT_LENGTHS, seed=9)
    largest_difference = largest_logit_difference(default, widening, "OCTAVO_CPU_INT8_CACHE_DOT", "float", models,
                                                  prompts, MAX_TOKENS, monkeypatch)
    # AVX-512 builds took the integer path by default (other roundings than widening's); lower builds always widen.
    assert (largest_difference > 0) == (cpu_target().level == "avx512")
