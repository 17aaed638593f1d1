"""End to end: a bfloat16 model with an int8 KV cache on the default engine (cpu backend, compiled executor).

A tiny Llama with 32-dim heads (the integer decode path takes whole 32-value parts) in bfloat16 with
`--kv-cache-dtype int8`, run twice on the compiled executor: as users get it (the decode attention multiplies
int16 pairs where the build has them: AVX-512, where the logits then differ from widening's somewhere) and with
OCTAVO_CPU_INT8_CACHE_DOT=float (every row widened to float32; builds below AVX-512 always widen).
Both read the same int8 cache; they differ only in how the attention rounds, so every sampled row's logits must
be within BF16_ERROR_FACTOR times the size of one bfloat16 rounding of this model (HF bfloat16 against HF float32
on the same context) of each other, and the greedy tokens must agree except at a near tie (the two tokens' float
path logits within twice that of each other), after which a sequence is compared no further.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from octavo.codegen.cpu_backend.isa import cpu_target
from octavo.compiler import compile_model
from octavo.config import CompileConfig, EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

PROMPT_LENGTHS = [6, 23, 40]
MAX_TOKENS = 12
BF16_ERROR_FACTOR = 2.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    directory = tmp_path_factory.mktemp("tiny-llama-d32")
    make_tiny_model("llama", hidden_size=128).save_pretrained(directory)  # 4 heads of 32 dims, 2 kv heads
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory / file.name)
    return directory


def make_engine(artifact) -> LLMEngine:
    # The suite runs eagerly unless a test asks (tests/conftest.py); users' engines default to the compiled executor.
    return LLMEngine(artifact, EngineConfig(executor="compiled", num_kv_blocks=32, max_num_seqs=4,
                                            max_num_batched_tokens=32))


def sampled(engine: LLMEngine) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Request id -> (the context its last step's logits row follows, that row), for the rows the step sampled."""
    record = engine.last_step
    rows = {}
    for row, index in enumerate(record.inputs.sampled_rows):
        seq = record.schedule.scheduled[index].seq
        rows[seq.request_id] = (seq.token_ids[:seq.num_computed_tokens], record.logits[row].float())
    return rows


def rounding_size(exact, hf_bf16, context: list[int]) -> float:
    with torch.no_grad():
        logits = [model(torch.tensor([context]), logits_to_keep=1).logits[0, -1].float() for model in (exact, hf_bf16)]
    return (logits[1] - logits[0]).abs().max().item()


def test_default_engine_decodes_an_int8_cache_as_the_widening_path_does(model_dir, tmp_path, cpu_kernels, one_thread,
                                                                       compiled_cache, monkeypatch):
    artifact = compile_model(model_dir, tmp_path / "artifact", CompileConfig(dtype="bfloat16", kv_cache_dtype="int8"))
    monkeypatch.delenv("OCTAVO_CPU_INT8_CACHE_DOT", raising=False)
    default, widening = make_engine(artifact), make_engine(artifact)
    assert default.executor_kind == "compiled" and default.backend == "cpu"
    assert default.kv_cache.tensors[next(iter(default.kv_cache.tensors))].dtype == torch.int8

    exact, hf_bf16 = (AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=dtype).eval()
                      for dtype in (torch.float32, torch.bfloat16))
    generator = torch.Generator().manual_seed(9)
    for length in PROMPT_LENGTHS:
        prompt = torch.randint(3, 49000, (length,), generator=generator).tolist()
        for engine in (default, widening):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    diverged: set[str] = set()
    compared = equal_tokens = 0
    largest_difference = 0.0
    while default.has_unfinished_requests():
        monkeypatch.delenv("OCTAVO_CPU_INT8_CACHE_DOT", raising=False)
        default.step()
        monkeypatch.setenv("OCTAVO_CPU_INT8_CACHE_DOT", "float")
        widening.step()
        theirs = sampled(widening)
        for request_id, (context, logits) in sampled(default).items():
            if request_id in diverged:
                continue
            assert theirs[request_id][0] == context
            bound = BF16_ERROR_FACTOR * rounding_size(exact, hf_bf16, context)
            difference = (logits - theirs[request_id][1]).abs().max().item()
            assert difference <= bound, f"{request_id}: logits {difference:.4f} apart, allowed {bound:.4f}"
            largest_difference = max(largest_difference, difference)
            compared += 1
            ours, reference = int(logits.argmax()), int(theirs[request_id][1].argmax())
            if ours == reference:
                equal_tokens += 1
                continue
            gap = (theirs[request_id][1][reference] - theirs[request_id][1][ours]).item()
            assert gap <= 2 * bound, f"{request_id}: token {ours}, the widening path's {reference}, {gap:.4f} apart"
            diverged.add(request_id)
    assert not widening.has_unfinished_requests()
    assert equal_tokens >= len(PROMPT_LENGTHS) * MAX_TOKENS // 2, f"only {equal_tokens} of {compared} tokens equal"
    # AVX-512 builds took the integer path by default (other roundings than widening's); lower builds always widen.
    assert (largest_difference > 0) == (cpu_target().level == "avx512")
