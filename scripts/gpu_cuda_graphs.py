"""CUDA graphs of decode steps on a GPU: capture/replay equality and timing with and without graphs.

Run on a machine with a CUDA GPU (scripts/gpu_check.sh does): ``python tests/runtime/cuda_graph_check.py``.
On SmolLM2-135M fp32 with the triton backend:

1. replay equals eager: for every ladder size of max_num_seqs 8 (1, 2, 4, 8) a decode step on the
   padded buffers is run once through its captured graph and once eagerly; the logits must be
   bitwise equal (the same kernels with the same launch parameters);
2. greedy outputs with graphs equal those without: 8 requests stopping 6 tokens apart, so the decode
   batch shrinks through sizes that pad (7 -> 8, 5-6 -> 8, 3 -> 4);
3. timing: decode steps per second at 1 and 8 sequences, with and without graphs.
Prints one line per check; exits 1 if a check fails.
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch

from octavo.compiler import compile_model
from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.input_batch import build_step_inputs
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import ScheduledSequence

MAX_SEQS = 8
NEW_TOKENS = 48
TIMED_STEPS = 40


def engine(artifact, executor: str) -> LLMEngine:
    return LLMEngine(artifact, EngineConfig(device="cuda", backend="triton", executor=executor, num_kv_blocks=512,
                                            max_num_seqs=MAX_SEQS))


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49000, (20 + 13 * index,), generator=generator).tolist() for index in range(MAX_SEQS)]


def greedy_outputs(llm: LLMEngine) -> list[list[int]]:
    for index, prompt in enumerate(prompts()):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS - 6 * index, ignore_eos=True),
                        request_id=str(index))
    finished = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    return [finished[str(index)] for index in range(MAX_SEQS)]


def check_replay_equals_eager(llm: LLMEngine) -> bool:
    for index, prompt in enumerate(prompts()):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), request_id=f"r{index}")
    while any(seq.num_output_tokens == 0 for seq in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    ok = True
    for size in llm.runner.buffers.ladder:
        sequences = llm.scheduler.running[:size]
        for seq in sequences:
            llm.block_manager.allocate(seq, seq.num_computed_tokens + 1)
        inputs = build_step_inputs([ScheduledSequence(seq, 1) for seq in sequences], llm.block_manager.block_size)
        feed = llm.runner.prepare(inputs)
        replayed = llm.runner.execute(feed)
        eager = llm.executor.run(feed.tensors)[:feed.num_rows]
        same = torch.equal(replayed, eager)
        print(f"  size {size}: replay {'==' if same else '!='} eager (max diff {(replayed - eager).abs().max():.3g})")
        ok &= same
    for index in range(MAX_SEQS):
        llm.abort_request(f"r{index}")
    return ok


def decode_steps_per_second(llm: LLMEngine, batch: int) -> float:
    for index in range(batch):
        llm.add_request(prompts()[index], SamplingParams(temperature=0, max_tokens=TIMED_STEPS + 8, ignore_eos=True),
                        request_id=f"t{index}")
    for _ in range(4):  # prefill, then captures (with graphs) and warm-up
        llm.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        llm.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    for index in range(batch):
        llm.abort_request(f"t{index}")
    return TIMED_STEPS / seconds


def main() -> int:
    artifact = compile_model("smollm2-135m", tempfile.mkdtemp(prefix="octavo-cuda-graphs-") + "/artifact")
    graphs, eager = engine(artifact, "compiled"), engine(artifact, "eager")
    assert graphs.executor_kind == "cuda graphs" and eager.executor_kind == "eager"
    ok = check_replay_equals_eager(graphs)
    print(f"replay equals eager for every ladder size: {ok}")
    with_graphs, without = greedy_outputs(graphs), greedy_outputs(eager)
    same = with_graphs == without
    print(f"greedy outputs with graphs == without: {same} ({sum(map(len, with_graphs))} tokens)")
    ok &= same
    for batch in (1, MAX_SEQS):
        fast, slow = decode_steps_per_second(graphs, batch), decode_steps_per_second(eager, batch)
        print(f"decode at {batch} sequence(s): {fast:.0f} steps/s with CUDA graphs, {slow:.0f} without "
              f"({fast / slow:.2f}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
