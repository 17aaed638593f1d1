"""A quantized artifact (w4 weights, int8 KV cache) batches like any: prefix caching and preemption change nothing.

Cached blocks hold quantized keys and values with their scales; a prefix hit must reuse
exactly what a recomputation would write, and swapping a sequence out and back in must
carry the scale blocks with the cache blocks.

The engines run the torch backend, whose kernels compute in float32 whatever the batch: a
token must then be the same however the prompts are chunked and batched. The cpu backend's
quantized GEMMs take bfloat16 activations above a few rows where the CPU has native bfloat16
(weight_packing), so on such a CPU a chunked prefill rounds differently from a whole one and
a near tie of the tiny random model (top-2 logprobs 5e-4 apart) can flip; its engine is
checked against the reference op elsewhere (tests/codegen/cpu).
"""

from __future__ import annotations

import random

import pytest

from octavo.runtime.loader import load_artifact
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import greedy, random_tokens, run_to_completion
from tests.runtime.engine_helpers import make_engine as make_float32_engine

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 16


@pytest.fixture(scope="module")
def artifact(tiny_quantized_artifact):
    return load_artifact(tiny_quantized_artifact("llama", quant="w4", kv_cache_dtype="int8"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    system = random_tokens(rng, 40)
    return [system + random_tokens(rng, 6), random_tokens(rng, 30), system + random_tokens(rng, 13),
            list(system), random_tokens(rng, 9) + system]


def make_engine(artifact, **options):
    return make_float32_engine(artifact, backend="torch", **options)


def generate(engine, prompts: list[list[int]], tokens: int = 12) -> list[list[int]]:
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, greedy(tokens), request_id=str(index))
    finals = run_to_completion(engine)
    assert_pool_full(engine)
    return [finals[str(index)].outputs[0].token_ids for index in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(artifact, prompts) -> list[list[int]]:
    """No prefix caching, a pool that holds everything: no block is shared, moved or recomputed."""
    assert artifact.manifest["kv_layout"]["cache_dtype"] == "int8"
    assert artifact.manifest["quantization"]["scheme"] == "w4"
    engine = make_engine(artifact, num_kv_blocks=64, enable_prefix_caching=False)
    return generate(engine, prompts)


def test_prefix_caching_on_equals_off(artifact, prompts, reference):
    engine = make_engine(artifact, num_kv_blocks=64, max_num_batched_tokens=24)
    assert generate(engine, prompts) == reference
    again = make_engine(artifact, num_kv_blocks=64)
    for index, prompt in enumerate(prompts):  # one at a time: each reuses the blocks cached before it
        assert generate(again, [prompt]) == [reference[index]]
    # Prompts 2 and 3 find the system prompt's two full blocks cached (prompt 3 recomputes its last token).
    assert again.block_manager.stats.hit_tokens == 2 * 2 * BLOCK


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_changes_nothing(artifact, prompts, reference, mode):
    # 5 blocks = 80 token slots: the longest sequence (61 tokens) fits, the batch does not.
    engine = make_engine(artifact, num_kv_blocks=5, max_num_batched_tokens=32, preemption_mode=mode,
                         swap_space="64KiB", enable_prefix_caching=False)
    assert generate(engine, prompts) == reference
    assert engine.scheduler.preemptions[mode] > 0, f"the small pool was meant to force {mode} preemption"
