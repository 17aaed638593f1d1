"""End to end: a model compiled with `--quant w8a8` on the default engine (cpu backend, compiled executor) against
the same artifact on the torch backend's eager engine.

Both engines round every linear's input (but the logits') to int8 in groups of 64 columns: the cpu backend with
octavo_cpu::linear_w8a8 (vpdpbusd where the CPU has AVX512_VNNI), the torch backend with octavo_torch::linear_w8a8
(its own implementation of the definition in torch ops). The rest of each engine is its own too (attention, norms,
the compiled graph's fusions). In float32 those differ by float32 roundings, so an activation lands on the other side
of an int8 rounding boundary only where it lies within ~2^-24 of one: a few values a step, each moved by one level
(max|group| / 127). One bfloat16 rounding of the model moves every activation by up to 2^-8 of itself, the largest
of a group by half such a level: the agreement tests/codegen/cpu/engine_pairs.py states (a small multiple of one
bfloat16 rounding of the model, tokens equal but at near ties) holds the two engines with room. In bfloat16 the
engines' own roundings would move many activations across boundaries, which is not what this test is about.
"""

from __future__ import annotations

import pytest
import torch

from octavo.compiler import compile_model
from octavo.config import CompileConfig, EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from tests.codegen.cpu.engine_pairs import (
    largest_logit_difference,
    make_engine,
    random_prompts,
    reference_models,
    tiny_llama_d32,
)

PROMPT_LENGTHS = [5, 12, 40, 70]  # one group of 64 columns or less per row, and tiles of 4 rows with tails
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    return tiny_llama_d32(tmp_path_factory.mktemp("tiny-llama-w8a8"), tokenizer_dir)


def linear_targets(engine: LLMEngine) -> list[str]:
    return [str(node.target) for node in engine.executor.graph_module.graph.nodes
            if node.op == "call_function" and "linear" in str(node.target)]


def test_default_engine_runs_w8a8_as_the_torch_backend_does(model_dir, tmp_path, cpu_kernels, one_thread,
                                                           compiled_cache, monkeypatch):
    artifact = tmp_path / "artifact"
    compile_model(model_dir, artifact, CompileConfig(dtype="float32", quant="w8a8"))
    default = make_engine(artifact)
    assert default.executor_kind == "compiled" and default.backend == "cpu"
    reference = LLMEngine(artifact, EngineConfig(backend="torch", executor="eager", num_kv_blocks=32, max_num_seqs=4,
                                                 max_num_batched_tokens=32))
    # Every linear but the logits' takes the int8-activation kernel of its backend.
    ours, theirs = linear_targets(default), linear_targets(reference)
    assert ours[:-1] == ["octavo_cpu.linear_w8a8.default"] * (len(ours) - 1) and len(ours) > 1
    assert theirs[:-1] == ["octavo_torch.linear_w8a8.default"] * (len(theirs) - 1)
    assert "w8a8" not in ours[-1] and "w8a8" not in theirs[-1]
    largest_logit_difference(default, reference, None, None, reference_models(model_dir),
                             random_prompts(PROMPT_LENGTHS, seed=8), MAX_TOKENS, monkeypatch)


def test_w8a8_rounds_the_activations_that_w8_keeps(model_dir, tmp_path, cpu_kernels):
    """The same weights as --quant w8 (one scale per output channel, the same values); only the activations differ,
    so the first step's logits differ from w8's (how much that costs on a real model: test_quantization_smollm2)."""
    engines = {}
    for quant in ("w8", "w8a8"):
        compile_model(model_dir, tmp_path / quant, CompileConfig(dtype="float32", quant=quant))
        engines[quant] = LLMEngine(tmp_path / quant, EngineConfig(num_kv_blocks=32, max_num_seqs=1))
    stored = {quant: engine.artifact.weights for quant, engine in engines.items()}
    assert stored["w8"].keys() == stored["w8a8"].keys()
    assert all(torch.equal(stored["w8"][name], stored["w8a8"][name]) for name in stored["w8"])
    prompt = random_prompts([20], seed=9)[0]
    logits = {}
    for quant, engine in engines.items():
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
        engine.step()
        logits[quant] = engine.last_step.logits[0].float()
    difference = (logits["w8"] - logits["w8a8"]).abs().max().item()
    assert difference > 0
