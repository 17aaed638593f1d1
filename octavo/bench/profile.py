"""`octavo bench --profile`: where the time of one engine step goes.

Three scenarios on the engine as configured: a decode step at 1 sequence, a
decode step at 64 sequences (contexts spread evenly over 64-640 tokens), and
one 512-token prefill; given a structured-output constraint, also the 64-sequence
decode step with every sequence under it, whose `grammar` phase is the time the
step waited for its token masks after the model (they are computed on a worker
thread while the model runs) and whose `sample` phase includes applying them.
For each, the step is split in two ways:

- by phase, from wall-clock timers around the engine's own phases (no profiler
  attached, the median over several steps): scheduling, input building, the
  model, bookkeeping after it, sampling, detokenization (with stop checks),
  output collection;
- the model phase by what ran inside it, from one step under torch.profiler:
  linears (GEMMs), attention (the paged-attention op with the KV write),
  collectives (a parallel engine's all-reduces and all-gathers on rank 0,
  waits for the slowest rank included), other kernels (norms, RoPE,
  activations, fused pointwise groups, embedding, views), and graph dispatch:
  the model's time outside any op, which is the Python (or compiled wrapper)
  code that calls the ops; a mixture of experts' op is split by the ranges its
  kernel records into moe routing (router linear, softmax, top-k), moe
  permutation (sorting the token-expert pairs by expert, gathering rows,
  summing the weighted results) and moe experts (the chosen experts' GEMMs).
  The profiler adds a few microseconds per op, so these figures are read as
  shares, not absolutes.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.step_phases import PHASE_LABEL_PREFIX
from octavo.runtime.structured import StructuredOutputs

PHASES = ("schedule", "inputs", "model", "grammar", "bookkeeping", "sample", "detokenize", "outputs")
MODEL_PARTS = ("linears", "attention", "collectives", "moe routing", "moe permutation", "moe experts",
               "other kernels", "graph dispatch")
# The ranges a moe kernel records inside its op (octavo_cpu::moe_routing, octavo_torch::moe_experts, ...).
MOE_RANGES = {"moe_routing": "moe routing", "moe_permutation": "moe permutation", "moe_experts": "moe experts"}
CONTEXT_RANGE = (64, 640)
PREFILL_TOKENS = 512
MEASURED_STEPS = 5
WARM_STEPS = 2

# Profiler ranges that only wrap a compiled graph: looked through when finding the ops a model step ran.
_WRAPPER_PREFIXES = ("## ", "Torch-Compiled Region", "TorchDynamo", "CompiledFunction", "AOTDispatcher",
                     "Pregraph bytecode", "Call CompiledFxGraph", "cudaGraph")
# Name parts of GEMM ops: ATen's, the compiled graph's C shims (aoti_torch_cpu_mm_out), oneDNN's, octavo's linears.
_LINEAR_WORDS = {"mm", "addmm", "bmm", "matmul", "linear", "mkldnn", "mkl", "onednn"}


@dataclass
class StepProfile:
    """One scenario: median seconds per phase, and the model phase split by op kind (profiled step)."""

    name: str
    num_tokens: int
    phase_seconds: dict[str, float]
    model_parts: dict[str, float] = field(default_factory=dict)
    profiled_model_seconds: float = 0.0

    @property
    def step_seconds(self) -> float:
        return sum(self.phase_seconds.values())

    @property
    def host_seconds(self) -> float:
        """Everything but the model: the engine's own work per step."""
        return self.step_seconds - self.phase_seconds.get("model", 0.0)


def profile_engine(engine: LLMEngine, vocab_ids: list[int], batch_sizes: Iterable[int] = (1, 64),
                   structured: StructuredOutputs | None = None) -> list[StepProfile]:
    """Run every scenario on `engine` (which must be idle) with prompts drawn from `vocab_ids`; with
    `structured`, also the largest decode batch under that constraint."""
    generator = torch.Generator().manual_seed(0)
    profiles = [_decode_profile(engine, batch, vocab_ids, generator) for batch in batch_sizes]
    if structured is not None:
        profiles.append(_decode_profile(engine, max(batch_sizes), vocab_ids, generator, structured))
    profiles.append(_prefill_profile(engine, vocab_ids, generator))
    return profiles


def decode_contexts(batch: int) -> list[int]:
    """Context lengths of a decode batch: evenly spread over CONTEXT_RANGE; one sequence sits mid-range."""
    low, high = CONTEXT_RANGE
    if batch == 1:
        return [(low + high) // 2]
    return [low + (high - low) * index // (batch - 1) for index in range(batch)]


def _draw(vocab_ids: list[int], count: int, generator: torch.Generator) -> list[int]:
    picks = torch.randint(len(vocab_ids), (count,), generator=generator).tolist()
    return [vocab_ids[pick] for pick in picks]


def _decode_profile(engine: LLMEngine, batch: int, vocab_ids: list[int], generator,
                    structured: StructuredOutputs | None = None) -> StepProfile:
    contexts = decode_contexts(batch)
    # No sequence may finish while the later prompts still prefill (one step per token budget at
    # worst, one per prompt at least), nor during the measured steps: all `batch` decode together.
    prefill_steps = -(-sum(contexts) // engine.config.max_num_batched_tokens) + batch
    params = SamplingParams(temperature=0.0, ignore_eos=True, structured=structured,
                            max_tokens=prefill_steps + WARM_STEPS + MEASURED_STEPS + 2)
    # A prompt of context - 1 tokens: its first decode step attends over `context` tokens.
    requests = [engine.add_request(_draw(vocab_ids, context - 1, generator), params) for context in contexts]
    while any(seq.num_output_tokens == 0 for request in requests for seq in request.sequences):
        engine.step()
    constrained = f", {structured.kind} constrained" if structured is not None else ""
    profile = _measure(engine, f"decode, {batch} sequence{'s' if batch > 1 else ''}{constrained}", batch)
    decoding = len(engine.last_step.schedule.scheduled)
    if decoding != batch:
        raise RuntimeError(f"the decode profile meant {batch} sequences per step but the last step ran {decoding}")
    for request in requests:
        engine.abort_request(request.request_id)
    return profile


def _prefill_profile(engine: LLMEngine, vocab_ids: list[int], generator) -> StepProfile:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    runs = []
    for _ in range(WARM_STEPS + MEASURED_STEPS):
        engine.add_request(_draw(vocab_ids, PREFILL_TOKENS, generator), params)
        with engine.phases.record() as seconds:
            engine.step()
        runs.append(dict(seconds))
    profile = StepProfile(f"prefill, {PREFILL_TOKENS} tokens", PREFILL_TOKENS, _median(runs[WARM_STEPS:]))
    engine.add_request(_draw(vocab_ids, PREFILL_TOKENS, generator), params)
    profile.model_parts, profile.profiled_model_seconds = profiled_step(engine)
    return profile


def _measure(engine: LLMEngine, name: str, num_tokens: int) -> StepProfile:
    for _ in range(WARM_STEPS):
        engine.step()
    runs = []
    for _ in range(MEASURED_STEPS):
        with engine.phases.record() as seconds:
            engine.step()
        runs.append(dict(seconds))
    profile = StepProfile(name, num_tokens, _median(runs))
    profile.model_parts, profile.profiled_model_seconds = profiled_step(engine)
    return profile


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {phase: statistics.median(run.get(phase, 0.0) for run in runs) for phase in PHASES}


def profiled_step(engine: LLMEngine) -> tuple[dict[str, float], float]:
    """One step under torch.profiler: seconds of the model phase per MODEL_PARTS kind, and its total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler, engine.phases.record():
        engine.step()
        if engine.parallel is not None:
            # A step's sends complete when their receivers take them, after the step: one that began under the
            # profiler and completed after it stopped corrupted the heap (7 crashes in 9 TP=2 runs, none since).
            engine.parallel.transport.flush()
    return split_model_time(profiler.events())


def split_model_time(events) -> tuple[dict[str, float], float]:
    """Split the octavo::model range of a profiler trace into MODEL_PARTS (seconds) and its total."""
    label = PHASE_LABEL_PREFIX + "model"
    regions = [event for event in events if event.name == label]
    total = sum(event.cpu_time_total for event in regions) / 1e6
    parts = dict.fromkeys(MODEL_PARTS, 0.0)
    for event in events:
        if _is_wrapper(event.name) or event.name == label:
            continue
        parent = event.cpu_parent
        while parent is not None and _is_wrapper(parent.name):
            parent = parent.cpu_parent
        if parent is None or parent.name != label:
            continue
        if _is_moe(event.name):
            _split_moe(event, parts)
            continue
        parts[_kind(event.name)] += event.cpu_time_total / 1e6
    parts["graph dispatch"] = max(0.0, total - sum(parts.values()))
    return parts, total


def _is_moe(name: str) -> bool:
    return name.endswith("::moe")


def _split_moe(event, parts: dict[str, float]) -> None:
    """A moe op's time by the ranges its kernel recorded (nested ones included); the rest is permutation."""
    recorded = 0.0
    stack = list(event.cpu_children)
    while stack:
        child = stack.pop()
        part = MOE_RANGES.get(child.name.rsplit("::", 1)[-1])
        if part is None:
            stack.extend(child.cpu_children)
            continue
        parts[part] += child.cpu_time_total / 1e6
        recorded += child.cpu_time_total / 1e6
    parts["moe permutation"] += max(0.0, event.cpu_time_total / 1e6 - recorded)


def _is_wrapper(name: str) -> bool:
    return name.startswith(_WRAPPER_PREFIXES)


def _kind(name: str) -> str:
    lowered = name.lower()
    if "paged_attention" in lowered:
        return "attention"
    if lowered.startswith("octavo_rank::"):
        return "collectives"
    if _LINEAR_WORDS & set(re.split(r"[^a-z0-9]+", lowered)) or "linear" in lowered:
        return "linears"
    return "other kernels"


def format_profiles(profiles: list[StepProfile]) -> list[str]:
    """Readable lines: per scenario the phase split and the model split, in ms and % of the step."""
    lines = []
    for profile in profiles:
        step = profile.step_seconds
        host_share = profile.host_seconds / step if step else 0.0
        lines.append(f"{profile.name}: step {step * 1e3:.1f} ms ({profile.num_tokens / step:.0f} tokens/s), "
                     f"host work {profile.host_seconds * 1e3:.1f} ms = {host_share:.1%} of the step")
        lines.append("  phases:  " + ", ".join(f"{phase} {seconds * 1e3:.2f} ms ({seconds / step:.1%})"
                                               for phase, seconds in profile.phase_seconds.items()))
        model = profile.profiled_model_seconds
        if model:
            lines.append(f"  model under torch.profiler {model * 1e3:.1f} ms: " + ", ".join(
                f"{part} {seconds * 1e3:.2f} ms ({seconds / model:.1%})"
                for part, seconds in profile.model_parts.items()
                if seconds or not (part == "collectives" or part.startswith("moe"))))
    return lines
