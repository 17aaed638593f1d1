"""The Hugging Face side of the GPU check: the reference model, teacher forcing, and `generate` as the peer.

Teacher forcing: Octavo generates greedily, keeping each sampled logits row; HF is fed each prompt plus
Octavo's tokens and scores the same positions. Per position: the relative error of Octavo's logits
||o - h|| / ||h||, whether Octavo's token is HF's argmax, and HF's gap from its top logit to Octavo's
token. The peer is HF `generate` with a static KV cache, which transformers compiles (torch.compile,
mode reduce-overhead: CUDA graphs) on an accelerator, batched: all prompts left-padded to the longest in
as few batches as memory allows.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from gpu_records import CUDA, DEVICE, sync

from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams


def hf_model(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, device_map=DEVICE.type).eval()


def octavo_greedy_logits(llm: LLMEngine, prompts: list[list[int]], num_tokens: int) -> list[tuple[list, torch.Tensor]]:
    """Per prompt: Octavo's greedy tokens and the logits row each was sampled from ([num_tokens, V] float32)."""
    for index, prompt in enumerate(prompts):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True),
                        request_id=f"tf{index}")
    rows: dict[str, list[torch.Tensor]] = {f"tf{index}": [] for index in range(len(prompts))}
    tokens: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        step = llm.last_step
        for row, scheduled_index in enumerate(step.inputs.sampled_rows):
            rows[step.schedule.scheduled[scheduled_index].seq.request_id].append(step.logits[row].float())
    return [(tokens[key], torch.stack(rows[key])) for key in rows]


@dataclass
class TeacherForcing:
    positions: int
    exact: int              # Octavo's token is HF's argmax
    worst_gap: float        # HF's top logit minus its logit of Octavo's token, the largest over positions
    worst_gap_share: float  # that gap over |HF's top logit| at its position
    outside_top5: int
    max_relative_error: float
    median_relative_error: float


@torch.no_grad()
def teacher_forcing(model, prompts: list[list[int]], generated: list[tuple[list, torch.Tensor]]) -> TeacherForcing:
    exact = outside = 0
    worst_gap, worst_share, errors = 0.0, 0.0, []
    for prompt, (tokens, ours) in zip(prompts, generated, strict=True):
        context = torch.tensor([prompt + tokens[:-1]], device=DEVICE)
        theirs = model(context).logits[0, len(prompt) - 1:].float()
        chosen = torch.tensor(tokens, device=DEVICE)
        top = theirs.max(dim=1).values
        gaps = top - theirs.gather(1, chosen[:, None])[:, 0]
        exact += int((gaps == 0).sum())
        outside += int((~(theirs.topk(5, dim=1).indices == chosen[:, None]).any(dim=1)).sum())
        worst = int(gaps.argmax())
        if float(gaps[worst]) >= worst_gap:
            worst_gap, worst_share = float(gaps[worst]), float(gaps[worst] / top[worst].abs())
        errors += ((ours - theirs).norm(dim=1) / theirs.norm(dim=1)).tolist()
    return TeacherForcing(len(errors), exact, worst_gap, worst_share, outside, max(errors),
                          statistics.median(errors))


@dataclass
class GenerateRun:
    tokens_per_s: float
    batch: int
    first_run_s: float  # the first pass over every batch, compilation included
    compiled: bool


def hf_generate_throughput(model, prompts: list[list[int]], output_len: int) -> GenerateRun:
    """Output tokens/s of the second of two passes (the first compiles); batches halve until they fit."""
    batch = len(prompts)
    while True:
        try:
            return _two_passes(model, prompts, output_len, batch)
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            batch //= 2
            torch.cuda.empty_cache()


def _two_passes(model, prompts: list[list[int]], output_len: int, batch: int) -> GenerateRun:
    from transformers import GenerationConfig

    width = max(map(len, prompts))  # one static shape for every batch: compiled once
    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0,
                              eos_token_id=2, cache_implementation="static")
    times = []
    for _ in range(2):
        sync()
        start = time.perf_counter()
        for first in range(0, len(prompts), batch):
            chunk = prompts[first:first + batch]
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, prompt in enumerate(chunk):
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            with torch.inference_mode():
                model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), generation_config=config)
        sync()
        times.append(time.perf_counter() - start)
    return GenerateRun(len(prompts) * output_len / times[1], batch, times[0], compiled=CUDA)
