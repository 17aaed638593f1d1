"""GPU check step: CUDA graphs of decode steps on the ladder, against eager steps on the same padded inputs.

On the SmolLM2-shaped artifact (gpu_prepare.py), with max_num_seqs 8 (ladder 1, 2, 4, 8):

1. the engine's warm-up captured every ladder size, and a decode step makes no host sync
   (torch.cuda.set_sync_debug_mode("error") around an eager run of the padded step);
2. replay equals eager: for every ladder size, a decode step of that many sequences and one of the
   fewest that run at that size (the most padding rows) is replayed and run eagerly on the same
   buffers: logits bitwise equal;
3. lockstep: an engine with graphs and one running the same padded decode steps eagerly, both pools
   poisoned with NaN first, serve 8 requests of 40 down to 6 tokens (the batch shrinks through padded
   sizes). After every step the logits are bitwise equal, both caches are bitwise equal, and the slots
   a step changed are exactly its real tokens' slots (padding rows write nowhere). An engine running
   the steps unpadded is compared too: its GEMMs have fewer rows, so it may round differently
   (reported, not required to be equal);
4. decode steps per second at 1 and 8 sequences with and without graphs.
Dry run: the padded eager path stands in for the graphs (1 and 4 are not run), tiny model on the CPU.
"""

from __future__ import annotations

import time

import torch
from gpu_records import CUDA, DEVICE, artifact_dir, check, checking, figure, main_guard, not_run, sync

from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.input_batch import build_step_inputs
from octavo.runtime.loader import load_artifact
from octavo.runtime.model_runner import ModelRunner
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import ScheduledSequence

MAX_SEQS = 8
NEW_TOKENS = 40 if CUDA else 8
TIMED_STEPS = 40


def engine(artifact, executor: str, padded: bool = False) -> LLMEngine:
    """An engine on the check's device; `padded` runs decode steps eagerly on the ladder's padded buffers."""
    llm = LLMEngine(artifact, EngineConfig(device=DEVICE.type, backend="triton", executor=executor,
                                           num_kv_blocks=256, max_num_seqs=MAX_SEQS))
    if padded:
        max_blocks = -(-llm.max_model_len // llm.block_manager.block_size)
        llm.runner = ModelRunner(llm.executor, llm.kv_cache.tensors, MAX_SEQS, max_blocks, DEVICE, pad_decodes=True,
                                 cuda_graphs=False)
    return llm


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    first, step = (20, 13) if CUDA else (3, 2)
    return [torch.randint(3, 49000, (first + step * index,), generator=generator).tolist() for index in range(MAX_SEQS)]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def changed_slots(before: dict, after: dict) -> set[int]:
    slots = set()
    for name, tensor in after.items():
        changed = (bits(before[name]) != bits(tensor)).flatten(2).any(dim=2).flatten()
        slots |= set(torch.nonzero(changed).flatten().tolist())
    return slots


def check_warm_up(llm: LLMEngine) -> None:
    if not CUDA:
        return not_run("every ladder size captured by the warm-up", "no CUDA device")
    captured = sorted(llm.runner.graphs.graphs) if llm.runner.graphs.enabled else []
    check("every ladder size captured by the warm-up", captured == llm.runner.buffers.ladder,
          f"captured {captured} of ladder {llm.runner.buffers.ladder} in a warm-up of {llm.warmup_seconds:.1f}s")


def check_no_host_sync(llm: LLMEngine) -> None:
    """An eager run of a padded decode step (what the graphs capture) under set_sync_debug_mode("error")."""
    name = "no host sync in a decode step"
    with checking(name):
        feed = decode_feed(llm, 3)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            llm.executor.run(feed.tensors)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        check(name, True, f"an eager decode step of 3 sequences at ladder size {feed.size}, "
              "under torch.cuda.set_sync_debug_mode('error')")


def decode_feed(llm: LLMEngine, num_seqs: int):
    sequences = llm.scheduler.running[:num_seqs]
    for seq in sequences:
        llm.block_manager.allocate(seq, seq.num_computed_tokens + 1)
    return llm.runner.prepare(build_step_inputs([ScheduledSequence(seq, 1) for seq in sequences],
                                                llm.block_manager.block_size))


def check_replay_equals_eager(llm: LLMEngine) -> None:
    if not CUDA:
        not_run("no host sync in a decode step", "no CUDA device")
        return not_run("replay equals eager at every ladder size", "no CUDA device")
    for index, prompt in enumerate(prompts()):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), request_id=f"r{index}")
    while llm.scheduler.waiting or any(seq.num_output_tokens == 0 for seq in llm.scheduler.running):
        llm.step()
    check_no_host_sync(llm)
    results, previous = [], 0
    for size in llm.runner.buffers.ladder:
        # The full size, and the fewest sequences that run at it (the most padding rows).
        smallest, previous = previous + 1, size
        for num_seqs in sorted({smallest, size}):
            feed = decode_feed(llm, num_seqs)
            replayed = llm.runner.execute(feed)
            eager = llm.executor.run(feed.tensors)[:feed.num_rows]
            results.append((size, num_seqs, torch.equal(replayed, eager), (replayed - eager).abs().max().item()))
    for index in range(MAX_SEQS):
        llm.abort_request(f"r{index}")
    failed = [f"size {size} with {n}: max diff {diff:.3g}" for size, n, same, diff in results if not same]
    check("replay equals eager at every ladder size", not failed,
          "; ".join(failed) or f"{len(results)} steps bitwise equal (sizes {llm.runner.buffers.ladder}, full and "
          "with the most padding rows)")


def check_lockstep(artifact) -> None:
    name = "graph steps equal padded eager steps: logits, caches, written slots"
    with checking(name):
        engines = {"graphs": engine(artifact, "compiled" if CUDA else "eager", padded=not CUDA),
                   "padded": engine(artifact, "eager", padded=True), "unpadded": engine(artifact, "eager")}
        for llm in engines.values():
            for tensor in llm.kv_cache.tensors.values():
                tensor.fill_(float("nan"))
            for index, prompt in enumerate(prompts()):
                max_tokens = 2 + (NEW_TOKENS - 2) * (MAX_SEQS - index) // MAX_SEQS
                llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                request_id=str(index))
        problems, padded_steps, unpadded_diff, steps = [], 0, 0.0, 0
        graphs, padded, unpadded = engines.values()
        while graphs.has_unfinished_requests():
            before = {key: tensor.clone() for key, tensor in graphs.kv_cache.tensors.items()}
            for llm in engines.values():
                llm.step()
            steps += 1
            padded_steps += (graphs.runner.last_size or 0) > len(graphs.last_step.schedule.scheduled)
            if not torch.equal(graphs.last_step.logits, padded.last_step.logits):
                problems.append(f"step {steps}: logits differ")
            caches = graphs.kv_cache.tensors
            if not all(torch.equal(bits(caches[key]), bits(padded.kv_cache.tensors[key])) for key in caches):
                problems.append(f"step {steps}: caches differ")
            # Every slot is written once, by its token, over NaN: the changed slots are exactly the real ones.
            written = changed_slots(before, caches)
            expected = set(graphs.last_step.inputs.slot_mapping.tolist())
            if written != expected:
                problems.append(f"step {steps}: slots {sorted(written ^ expected)[:8]} written unexpectedly or not")
            if torch.equal(graphs.last_step.inputs.input_ids, unpadded.last_step.inputs.input_ids):
                unpadded_diff = max(unpadded_diff, (graphs.last_step.logits.float()
                                                    - unpadded.last_step.logits.float()).abs().max().item())
        detail = (f"{steps} steps, {padded_steps} of them padded decodes; "
                  f"{'; '.join(problems[:6]) or 'all bitwise equal, no slot written by a padding row'}")
        check(name, not problems and padded_steps > 0, detail)
        figure("padded vs unpadded decode logits, max |diff|", unpadded_diff, "logit",
               detail="the padded step's GEMMs have more rows, so cuBLAS/oneDNN may sum in another order")


def decode_steps_per_second(llm: LLMEngine, batch: int) -> float:
    for index in range(batch):
        llm.add_request(prompts()[index], SamplingParams(temperature=0, max_tokens=TIMED_STEPS + 8, ignore_eos=True),
                        request_id=f"t{index}")
    for _ in range(4):
        llm.step()
    sync()
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        llm.step()
    sync()
    seconds = time.perf_counter() - start
    for index in range(batch):
        llm.abort_request(f"t{index}")
    return TIMED_STEPS / seconds


def main() -> None:
    artifact = load_artifact(artifact_dir("smollm2-135m"), verify=False)
    graphs = engine(artifact, "compiled" if CUDA else "eager", padded=not CUDA)
    check_warm_up(graphs)
    check_replay_equals_eager(graphs)
    check_lockstep(artifact)
    if not CUDA:
        return not_run("decode steps per second with and without CUDA graphs", "no CUDA device", kind="figure")
    eager = engine(artifact, "eager")
    for batch in (1, MAX_SEQS):
        fast, slow = decode_steps_per_second(graphs, batch), decode_steps_per_second(eager, batch)
        figure(f"smollm2-135m decode steps/s at {batch} sequence(s) with CUDA graphs", fast, "steps/s",
               ratio=fast / slow, ratio_of="steps/s with graphs / without (eager executor)")


if __name__ == "__main__":
    main_guard(main)
