"""GPU check step: the engine step by step on every tiny architecture, triton vs torch backend vs Hugging Face.

For each architecture of the table (tests/tiny_models.py: 2 layers, GQA, fp32, random weights, the
generated tokenizer): five requests of different lengths arrive over two steps under a 20-token budget,
so steps mix decodes, whole prefills and prefill chunks. A triton engine and a torch-backend engine, both
eager (CUDA graphs are checked on the ladder by gpu_cuda_graphs.py: an engine with graphs warms up every
kernel variant first, which costs each architecture its own compiles), run in lockstep; every sampled
logits row of both must match the other and HF eager fp32 on the same device (context = the tokens
computed so far) within 1e-4, and their greedy tokens must be equal. Dry run: the triton engine runs in
Triton's interpreter on the CPU.
"""

from __future__ import annotations

import time

import torch
from gpu_records import DEVICE, check, checking, main_guard, work_dir

from octavo.bench.random_model import write_tokenizer
from octavo.compiler import compile_model
from octavo.config import CompileConfig, EngineConfig
from octavo.frontend.architectures import ARCHITECTURES
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from tests.tiny_models import VOCAB_SIZE, make_tiny_model

PROMPT_LENGTHS = [5, 47, 12, 31, 3]
MAX_TOKENS = [9, 6, 12, 8, 10]
TOKEN_BUDGET = 20
TOLERANCE = 1e-4  # fp32: the kernels sum in other orders, a few ulps of logits of magnitude < 10


def tiny_model(model_type: str):
    directory = work_dir() / "tiny" / model_type
    model = make_tiny_model(model_type)
    model.save_pretrained(directory)
    write_tokenizer(directory, VOCAB_SIZE)
    (work_dir() / "tiny-artifacts").mkdir(exist_ok=True)
    artifact = compile_model(directory, work_dir() / "tiny-artifacts" / model_type, CompileConfig(dtype="float32"),
                             overwrite=True)
    return model.to(DEVICE), artifact


def run_lockstep(model_type: str) -> None:
    start = time.perf_counter()
    reference, artifact = tiny_model(model_type)
    engines = [LLMEngine(artifact, EngineConfig(device=DEVICE.type, backend=backend, executor=executor,
                                                num_kv_blocks=64, max_num_seqs=8,
                                                max_num_batched_tokens=TOKEN_BUDGET))
               for backend, executor in (("triton", "eager"), ("torch", "eager"))]
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49000, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]
    worst = {"triton vs HF": 0.0, "torch vs HF": 0.0, "triton vs torch": 0.0}
    steps = compared = 0
    problems = []
    while steps == 0 or engines[0].has_unfinished_requests():
        if steps in (0, 2):  # late arrivals join while the first requests decode and prefill
            for index in ((0, 1, 2) if steps == 0 else (3, 4)):
                for llm in engines:
                    llm.add_request(prompts[index], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[index]),
                                    request_id=str(index))
        outputs = [{output.request_id: output.outputs[0].token_ids for output in llm.step()} for llm in engines]
        steps += 1
        triton_step, torch_step = (llm.last_step for llm in engines)
        if outputs[0] != outputs[1]:
            problems.append(f"step {steps}: greedy tokens differ")
        for row, scheduled_index in enumerate(triton_step.inputs.sampled_rows):
            seq = triton_step.schedule.scheduled[scheduled_index].seq
            with torch.no_grad():
                context = torch.tensor([seq.token_ids[:seq.num_computed_tokens]], device=DEVICE)
                expected = reference(context, logits_to_keep=1).logits[0, -1].float()
            ours, theirs = triton_step.logits[row].float(), torch_step.logits[row].float()
            for key, diff in (("triton vs HF", ours - expected), ("torch vs HF", theirs - expected),
                              ("triton vs torch", ours - theirs)):
                worst[key] = max(worst[key], diff.abs().max().item())
            compared += 1
    passed = not problems and compared == sum(MAX_TOKENS) and max(worst.values()) <= TOLERANCE
    detail = ", ".join(f"{key} {value:.2g}" for key, value in worst.items())
    check(f"engine step by step, {model_type}", passed,
          f"{compared} logits rows over {steps} steps: max |diff| {detail}"
          f"{'; ' + '; '.join(problems[:3]) if problems else ''}", time.perf_counter() - start)


def main() -> None:
    for model_type in sorted(ARCHITECTURES):
        with checking(f"engine step by step, {model_type}"):
            run_lockstep(model_type)


if __name__ == "__main__":
    main_guard(main)
