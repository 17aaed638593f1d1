"""End to end: a bfloat16 artifact's linears run octavo_cpu::linear_bf16 inside the compiled graph.

The tiny qwen2 (biased q/k/v projections, a tied lm_head) in bfloat16, on the cpu backend's compiled executor
(AOTInductor calls the op back for every linear), against the same artifact on the existing path (eager, with
OCTAVO_CPU_BF16_LINEAR=aten: ATen's linear) and against Hugging Face. Prompts of 1, 6 and 23 tokens make
prefills on both sides of the GEMV's 8 rows, and decode steps of 1 to 3 rows.

Every sampled row's logits must be as close to the exact (HF float32) logits as HF's own bfloat16 run is, within
a factor BF16_ERROR_FACTOR (tests/test_architectures.py's criterion: each run rounds the same arithmetic to
bfloat16 in its own order, so their errors are of one size). The greedy tokens must be the existing path's,
except where the exact logits of the two tokens lie within both runs' bounds of each other (a near tie that
either rounding may break); a sequence is compared no further once its tokens differ. The op packs each weight
once, at its first call, and reuses the packed copy at every later step.
"""

from __future__ import annotations

import torch

from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from tests.codegen.cpu.engine_pairs import random_prompts, reference_models, sampled

PROMPT_LENGTHS = [6, 23, 1]
MAX_TOKENS = 5
BF16_ERROR_FACTOR = 2.0


def make_engine(artifact, executor: str) -> LLMEngine:
    return LLMEngine(artifact, EngineConfig(backend="cpu", executor=executor, num_kv_blocks=32, max_num_seqs=4,
                                            max_num_batched_tokens=32))


def hf_last_logits(model, context: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([context]), logits_to_keep=1).logits[0, -1].float()


def test_compiled_bf16_graph_runs_the_native_linear(tiny_quantized_artifact, tiny_model_dir, cpu_kernels, one_thread,
                                                   compiled_cache, monkeypatch):
    artifact = tiny_quantized_artifact("qwen2", dtype="bfloat16")
    packings_before = torch.ops.octavo_cpu.linear_bf16_packings()
    monkeypatch.setenv("OCTAVO_CPU_BF16_LINEAR", "native")  # the default on CPUs with AMX; asked for on any
    native = make_engine(artifact, "compiled")
    monkeypatch.setenv("OCTAVO_CPU_BF16_LINEAR", "aten")
    existing = make_engine(artifact, "eager")
    assert native.executor_kind == "compiled"

    graph = native.executor.graph_module.graph
    routed = graph.find_nodes(op="call_function", target=torch.ops.octavo_cpu.linear_bf16.default)
    assert routed and not graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
    assert any(node.args[2:] and node.args[2] is not None for node in routed), "no biased linear"
    assert not existing.executor.graph_module.graph.find_nodes(op="call_function",
                                                                target=torch.ops.octavo_cpu.linear_bf16.default)
    assert "octavo_cpu::linear_bf16" in (native.executor.path / "model.json").read_text()

    directory = tiny_model_dir("qwen2")
    exact, hf_bf16 = reference_models(directory)
    for prompt in random_prompts(PROMPT_LENGTHS, seed=5):
        for engine in (native, existing):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    diverged: set[str] = set()
    compared = equal_tokens = 0
    while native.has_unfinished_requests():
        native.step()
        existing.step()
        theirs = sampled(existing)
        for request_id, (context, logits) in sampled(native).items():
            truth = hf_last_logits(exact, context)
            bound = BF16_ERROR_FACTOR * (hf_last_logits(hf_bf16, context) - truth).abs().max().item()
            error = (logits - truth).abs().max().item()
            assert error <= bound, f"{request_id}: {error:.4f} from the float32 logits, allowed {bound:.4f}"
            compared += 1
            if request_id in diverged:
                continue
            assert theirs[request_id][0] == context
            ours, reference = int(logits.argmax()), int(theirs[request_id][1].argmax())
            if ours != reference:
                gap = (truth[reference] - truth[ours]).abs().item()
                assert gap <= 2 * bound, f"{request_id}: token {ours}, the existing path's {reference}, {gap:.4f} apart"
                diverged.add(request_id)
            else:
                equal_tokens += 1
    assert not existing.has_unfinished_requests()
    assert compared == len(PROMPT_LENGTHS) * MAX_TOKENS
    assert equal_tokens >= compared // 2, f"only {equal_tokens} of {compared} tokens are the existing path's"
    weights = {node.args[1].target for node in routed}
    assert torch.ops.octavo_cpu.linear_bf16_packings() - packings_before == len(weights)
