"""LLMEngine: requests in, one scheduled + executed + sampled step at a time, outputs out."""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from octavo.config import EngineConfig
from octavo.errors import OctavoError, RequestError
from octavo.runtime.block_manager import BlockManager
from octavo.runtime.detokenizer import IncrementalDetokenizer
from octavo.runtime.executor import GraphExecutor
from octavo.runtime.input_batch import StepInputs, build_step_inputs
from octavo.runtime.kv_cache import KVCache, choose_num_blocks
from octavo.runtime.loader import LoadedArtifact, load_artifact
from octavo.runtime.outputs import Logprob, RequestOutput
from octavo.runtime.request import Request
from octavo.runtime.sampler import Sampler, SamplingRow
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import Scheduler, SchedulerOutput
from octavo.runtime.sequence import Sequence, SequenceStatus
from octavo.runtime.stop_checker import check_stop

logger = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """What the last step ran: the schedule, its inputs and the logits rows it produced (for debugging)."""

    schedule: SchedulerOutput
    inputs: StepInputs
    logits: torch.Tensor


class LLMEngine:
    """The synchronous engine: `add_request`, then `step()` until `has_unfinished_requests()` is false."""

    def __init__(self, artifact: str | os.PathLike | LoadedArtifact, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.artifact = artifact if isinstance(artifact, LoadedArtifact) else load_artifact(artifact)
        manifest = self.artifact.manifest
        self.device = resolve_device(self.config.device)
        self.backend = resolve_backend(self.config.backend, self.device)
        self.tokenizer = self.artifact.tokenizer
        self.eos_token_ids = self.artifact.eos_token_ids
        self.vocab_size = manifest["vocab_size"]
        self.max_model_len = min(self.config.max_model_len or manifest["max_model_len"], manifest["max_model_len"])
        layout = manifest["kv_layout"]
        num_blocks = choose_num_blocks(layout, self.config.kv_cache_memory, self.config.num_kv_blocks, self.device)
        self.kv_cache = KVCache(layout, num_blocks, self.device)
        capacity = num_blocks * layout["block_size"]
        if capacity < self.max_model_len:
            # A sequence longer than the whole pool could never be scheduled (it would preempt itself forever).
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len %d: sequences are capped at %d "
                           "tokens", capacity, self.max_model_len, capacity)
            self.max_model_len = capacity
        self.block_manager = BlockManager(num_blocks, layout["block_size"])
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.executor = GraphExecutor(self.artifact.graph_module, self.artifact.weights, self.backend, self.device)
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, seed=self.config.seed)
        self.requests: dict[str, Request] = {}
        self.last_step: StepRecord | None = None
        self._request_counter = itertools.count()
        logger.info("KV cache: %d blocks x %d tokens = %d token slots, %.1f MiB (%s, backend %s)",
                    num_blocks, layout["block_size"], num_blocks * layout["block_size"],
                    self.kv_cache.num_bytes / 2**20, self.device, self.backend)

    # ---- requests ----

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> Request:
        """Queue a request (text or token ids). Invalid requests raise RequestError and change nothing."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        request = Request(request_id, text, token_ids, params)
        for index in range(params.n):
            seq = Sequence(request_id, index, token_ids, params,
                           IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens,
                                                  params.spaces_between_special_tokens),
                           generator=_generator(params, index), priority=priority)
            request.sequences.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now: its sequences finish as "abort" and their blocks are freed."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                seq.finish_time = time.monotonic()
        return request.make_output()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        """Schedule, run the graph once, sample, and return the outputs of every request that changed."""
        schedule = self.scheduler.schedule()
        if schedule.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress although requests are waiting")
            return []
        inputs = build_step_inputs(schedule.scheduled, self.block_manager.block_size)
        feed = {**inputs.to(self.device).as_dict(), **self.kv_cache.tensors}
        logits = self.executor.run(feed)
        self.last_step = StepRecord(schedule, inputs, logits)
        sampled = [schedule.scheduled[row].seq for row in inputs.sampled_rows]
        for item in schedule.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        touched = {item.seq.request_id for item in schedule.scheduled}
        if sampled:
            self._sample_and_append(sampled, logits)
        return self._collect_outputs(touched)

    def _sample_and_append(self, sampled: list[Sequence], logits: torch.Tensor) -> None:
        rows = [SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator)
                for seq in sampled]
        result = self.sampler(logits, rows)
        token_ids = result.token_ids.tolist()
        logprobs = result.sampled_logprobs.tolist()
        for row, seq in enumerate(sampled):
            seq.append_token(token_ids[row])
            seq.cumulative_logprob += logprobs[row]
            if seq.output_logprobs is not None:
                seq.output_logprobs.append(self._logprob_entry(result, row, seq.params.logprobs))
            delta = seq.detokenizer.append([token_ids[row]])
            seq.output_text += delta
            decision = check_stop(seq.params, self.eos_token_ids, seq.output_token_ids, seq.output_text,
                                  len(delta), seq.num_tokens, self.max_model_len)
            if decision.finished:
                if decision.truncate_text_to is not None:
                    seq.output_text = seq.output_text[:decision.truncate_text_to]
                seq.stop_reason = decision.stop_reason
                status = (SequenceStatus.FINISHED_STOPPED if decision.finish_reason == "stop"
                          else SequenceStatus.FINISHED_LENGTH)
                self.scheduler.finish(seq, status)
                seq.finish_time = time.monotonic()

    def _logprob_entry(self, result, row: int, num_top: int) -> dict[int, Logprob]:
        token = int(result.token_ids[row])
        entry = {token: Logprob(float(result.sampled_logprobs[row]), int(result.sampled_ranks[row]),
                                self.tokenizer.decode([token]))}
        if num_top and result.top_token_ids is not None:
            for rank, (token_id, value) in enumerate(zip(result.top_token_ids[row, :num_top].tolist(),
                                                         result.top_logprobs[row, :num_top].tolist(),
                                                         strict=True), 1):
                entry.setdefault(token_id, Logprob(value, rank, self.tokenizer.decode([token_id])))
        return entry

    def _collect_outputs(self, request_ids: set[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in sorted(request_ids, key=lambda rid: self.requests[rid].arrival_time):
            request = self.requests[request_id]
            outputs.append(request.make_output())
            if request.finished:
                del self.requests[request_id]
        return outputs

    # ---- validation ----

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = [int(token) for token in prompt]
        if not token_ids:
            raise RequestError("the prompt is empty")
        bad = [token for token in token_ids if not 0 <= token < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return None, token_ids

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(token_ids)} tokens, but the model's max_model_len is "
                               f"{self.max_model_len} (prompt plus at least one generated token must fit)")
        params.verify_token_ids(self.vocab_size)
        needed = self.block_manager.blocks_for_tokens(len(token_ids) + 1)
        if needed > self.block_manager.num_blocks:
            raise RequestError(f"the prompt needs {needed} KV blocks but the cache has only "
                               f"{self.block_manager.num_blocks}; raise kv_cache_memory")


def _generator(params: SamplingParams, index: int) -> torch.Generator | None:
    if params.seed is None:
        return None
    # Sample i of a seeded n>1 request uses seed + i, so it equals a single request with that seed.
    return torch.Generator().manual_seed(params.seed + index)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise OctavoError("device cuda requested but no CUDA device is available")
    return torch.device(device)


def resolve_backend(backend: str, device: torch.device) -> str:
    """auto: triton on CUDA (when installed), torch on CPU. An explicit triton must be able to run there."""
    from octavo.codegen.triton_backend.availability import check_triton_backend

    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        if importlib.util.find_spec("triton") is None:
            logger.warning("triton is not installed: running the torch backend on CUDA")
            return "torch"
        return "triton"
    if backend == "triton":
        check_triton_backend(device)
    return backend


def artifact_path(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().resolve()
