"""LLMEngine: requests in, one scheduled + executed + sampled step at a time, outputs out."""

from __future__ import annotations

import importlib.util
import itertools
import logging
import operator
import os
import time
from pathlib import Path

import torch

from octavo.codegen.cpu_backend.precision import slow_dtype_warning
from octavo.config import EngineConfig
from octavo.errors import OctavoError, RequestError
from octavo.ir.lora_format import LoraAdapterError
from octavo.runtime.block_manager import BlockManager
from octavo.runtime.detokenizer import IncrementalDetokenizer
from octavo.runtime.distributed.devices import rank_device
from octavo.runtime.distributed.launch import RankLaunch
from octavo.runtime.distributed.pipelined_steps import PipelinedSteps
from octavo.runtime.executor_choice import create_executor, resolve_executor
from octavo.runtime.host_pool import HostBlockPool
from octavo.runtime.input_batch import StepInputs, build_step_inputs
from octavo.runtime.kv_cache import KVCache, bytes_per_block, choose_num_blocks
from octavo.runtime.loader import LoadedArtifact, load_artifact
from octavo.runtime.lora import LoraManager
from octavo.runtime.metrics import EngineMetrics, collect_engine_metrics
from octavo.runtime.model_runner import ModelRunner
from octavo.runtime.output_processor import OutputProcessor
from octavo.runtime.outputs import RequestOutput
from octavo.runtime.request import Request
from octavo.runtime.sampler import Sampler
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.scheduler import Scheduler, SchedulerOutput
from octavo.runtime.sequence import Sequence, SequenceStatus
from octavo.runtime.spec_decode.speculator import build_speculator
from octavo.runtime.step_phases import StepPhases
from octavo.runtime.step_record import StepRecord
from octavo.runtime.structured.manager import StructuredOutputManager
from octavo.runtime.structured.masks import StepMask
from octavo.runtime.warmup import warm_up, warmup_steps

logger = logging.getLogger(__name__)


class LLMEngine:
    """The synchronous engine: `add_request`, then `step()` until `has_unfinished_requests()` is false."""

    def __init__(self, artifact: str | os.PathLike | LoadedArtifact, config: EngineConfig | None = None,
                 launch: RankLaunch | None = None):
        """`launch` starts the ranks of a parallel engine (world_size > 1); octavo.parallel.create_engine
        makes it, since sharding the artifact for each rank runs the parallel passes."""
        self.config = config or EngineConfig()
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        if self.config.world_size > 1 and launch is None:
            raise OctavoError(f"an engine of {self.config.world_size} ranks is built by octavo.parallel.create_engine "
                              "(or octavo.LLM), which shards the artifact for each rank")
        self.artifact = artifact if isinstance(artifact, LoadedArtifact) else load_artifact(artifact)
        manifest = self.artifact.manifest
        if launch is not None:
            rendezvous = launch.rendezvous
            self.device = rank_device(self.config.device, rendezvous.local_rank, rendezvous.local_world_size)
        else:
            self.device = resolve_device(self.config.device)
        self.backend = resolve_backend(self.config.backend, self.device)
        if self.backend == "triton":
            from octavo.codegen.triton_backend.availability import check_triton_kv_layout, use_octavo_triton_cache

            check_triton_kv_layout(manifest["kv_layout"])
            use_octavo_triton_cache()
        if self.device.type == "cpu" and (slow := slow_dtype_warning(manifest["dtype"])):
            logger.warning(slow)
        self.tokenizer = self.artifact.tokenizer
        self.eos_token_ids = self.artifact.eos_token_ids
        self.vocab_size = manifest["vocab_size"]
        self.max_model_len = self._max_model_len(manifest)
        self._length_limit_note = ""
        layout = manifest["kv_layout"]
        self.parallel = None
        if launch is not None:
            from octavo.runtime.distributed import ParallelRuntime

            # Every rank holds its share of the cache (its heads, its stage's layers); rank 0's is the engine's.
            self.parallel = ParallelRuntime(self.artifact, self.config, self.backend, self.device, launch)
            layout, self.kv_cache = self.parallel.kv_layout, self.parallel.kv_cache
            num_blocks, num_host_blocks = self.kv_cache.num_blocks, self.kv_cache.num_host_blocks
        else:
            num_blocks = choose_num_blocks(layout, self.config.kv_cache_memory, self.config.num_kv_blocks,
                                           self.device)
            num_host_blocks = self._num_host_blocks(layout)
            self.kv_cache = KVCache(layout, num_blocks, self.device, num_host_blocks)
        self._cap_max_model_len(num_blocks * layout["block_size"])
        self.block_manager = BlockManager(num_blocks, layout["block_size"],
                                          enable_prefix_caching=self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.config.preemption_mode,
                                   HostBlockPool(num_host_blocks) if num_host_blocks else None)
        if self.parallel is not None:
            self.executor = self.parallel.executor
        else:
            self.executor = create_executor(self.artifact.graph_module, self.artifact.weights, manifest,
                                            self.backend, self.device, self.config.executor,
                                            activation_dtype=getattr(torch, manifest["dtype"]))
        self.lora = self._lora_manager(manifest)
        executor_kind = getattr(self.executor, "kind", "eager")
        # LoRA's token slots are no persistent buffer of the captured graphs (yet): such artifacts run uncaptured.
        cuda_graphs = (self.device.type == "cuda" and self.parallel is None and self.lora is None
                       and resolve_executor(self.config.executor) != "eager")
        bound = {**self.kv_cache.tensors, **(self.lora.tensors if self.lora is not None else {})}
        self.runner = ModelRunner(self.executor, bound, self.config.max_num_seqs,
                                  -(-self.max_model_len // layout["block_size"]), self.device,
                                  pad_decodes=executor_kind == "compiled", cuda_graphs=cuda_graphs)
        self.executor_kind = "cuda graphs" if cuda_graphs else executor_kind
        if self.parallel is not None:
            self.executor_kind = f"{executor_kind} on {self.config.world_size} ranks"
        self.warmup_seconds = 0.0
        if cuda_graphs:
            steps = warmup_steps(self.runner.buffers.ladder, self.config.max_num_batched_tokens,
                                 self.config.max_num_seqs, self.max_model_len, layout["block_size"])
            self.warmup_seconds = warm_up(self.runner, steps, layout["block_size"])
        self.pipeline = None
        if self.parallel is not None and self.config.pipeline_parallel_size > 1:

            self.pipeline = PipelinedSteps(self, self.config.pipeline_depth or self.config.pipeline_parallel_size)
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, seed=self.config.seed)
        self.phases = StepPhases()
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.step_mask: StepMask | None = None  # the banned tokens of the last step's constrained rows
        self.outputs = OutputProcessor(self.sampler, self.scheduler, self.tokenizer, self.eos_token_ids,
                                       self.max_model_len, self.phases, self.structured)
        self.speculator = build_speculator(self) if self.config.speculative else None
        self.requests: dict[str, Request] = {}
        self.last_step: StepRecord | None = None
        self.num_steps = 0
        self._request_counter = itertools.count()
        logger.info("KV cache: %d blocks x %d tokens = %d token slots, %.1f MiB (%s, backend %s, executor %s, "
                    "prefix caching %s, preemption %s, %d host blocks)", num_blocks, layout["block_size"],
                    num_blocks * layout["block_size"], self.kv_cache.num_bytes / 2**20, self.device, self.backend,
                    self.executor_kind,
                    "on" if self.config.enable_prefix_caching else "off", self.config.preemption_mode,
                    num_host_blocks)

    def _lora_manager(self, manifest: dict) -> LoraManager | None:
        """The adapter slots of an artifact compiled with LoRA, with its own and `lora_modules`' adapters loaded."""
        layout = manifest.get("lora")
        if not layout:
            if self.config.lora_modules:
                raise OctavoError("--lora-modules needs an artifact compiled with LoRA (octavo compile --lora "
                                  "NAME=PATH, or --lora-targets with --max-lora-rank)")
            return None
        if self.config.world_size > 1:
            raise OctavoError("LoRA adapters run on a single-process engine (not with tensor or pipeline parallelism)")
        if self.config.speculative:
            raise OctavoError("speculative decoding is not available with LoRA adapters yet")
        manager = LoraManager(layout, self.config.max_loras, getattr(torch, manifest["dtype"]), self.device)
        for entry in [*(f"{name}={path}" for name, path in layout.get("adapters", {}).items()),
                      *self.config.lora_modules]:
            name, _, path = entry.partition("=")
            manager.load(name, path)
        return manager

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter under `name` (LoraAdapterError, one line, when it cannot be served)."""
        if self.lora is None:
            raise LoraAdapterError("this artifact was compiled without LoRA: it cannot load adapters")
        self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Free an adapter's slot; refused while requests run under it."""
        if self.lora is None:
            raise LoraAdapterError("this artifact was compiled without LoRA: it has no adapters")
        users = sum(1 for request in self.requests.values() for seq in request.sequences if seq.lora_name == name)
        if users:
            raise LoraAdapterError(f"LoRA adapter {name!r} is in use by {users} running sequence(s)")
        self.lora.unload(name)

    def _max_model_len(self, manifest: dict) -> int:
        limit = manifest["max_model_len"]
        requested = self.config.max_model_len
        if requested is not None and requested > limit:
            raise OctavoError(f"max_model_len {requested} exceeds the model's limit of {limit} tokens")
        return requested or limit

    def _cap_max_model_len(self, capacity: int) -> None:
        if capacity < self.max_model_len:
            # A sequence longer than the whole pool could never be scheduled (it would preempt itself forever).
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len %d: sequences are capped at %d "
                           "tokens", capacity, self.max_model_len, capacity)
            self.max_model_len = capacity
            self._length_limit_note = ", limited by the KV cache size (raise kv_cache_memory)"

    def _num_host_blocks(self, layout: dict) -> int:
        if self.config.preemption_mode != "swap":
            return 0
        return max(1, int(self.config.swap_space // bytes_per_block(layout)))

    # ---- requests ----

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, lora: str | None = None) -> Request:
        """Queue a request (text or token ids). Invalid requests raise RequestError and change nothing.

        `lora` names a loaded LoRA adapter the request runs under (None: the base model).

        With n > 1, sample 0 computes the prompt; the other samples are forked
        from it (sharing its blocks) when its first token is sampled.
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        if lora is not None:
            if self.lora is None:
                raise RequestError(f"unknown LoRA adapter {lora!r}: this artifact was compiled without LoRA")
            self.lora.slot_of(lora)
        grammar = self.structured.start(params.structured) if params.structured is not None else None
        request = Request(request_id, text, token_ids, params, priority=priority)
        seq = Sequence(request_id, 0, token_ids, params, self._detokenizer(token_ids, params),
                       generator=_generator(params, 0), priority=priority, grammar=grammar, lora_name=lora)
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
            if self.speculator is not None:
                self.speculator.release(seq)
        request.aborted = True
        return request.make_output()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_metrics(self) -> EngineMetrics:
        return collect_engine_metrics(self)

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        """Schedule, run the graph once, sample, and return the outputs of every request that changed.

        With speculative decoding, proposals are made first and verified after the step.
        """
        if self.pipeline is not None and self.pipeline.depth > 1:
            return self.pipeline.step()
        proposals = self.speculator.propose() if self.speculator is not None else None
        executed = self.execute_step(proposals)
        if executed is None:
            return []
        schedule, inputs, logits = executed
        rows = []
        for row, scheduled_index in enumerate(inputs.sampled_rows):
            if scheduled_index in inputs.spec_rows:
                continue  # verified by the speculator below
            seq = schedule.scheduled[scheduled_index].seq
            rows.append((seq, row))
            rows += [(sibling, row) for sibling in self._fork_siblings(seq)]
        self.outputs.sample_and_append(rows, logits, self.step_mask)
        if self.speculator is not None:
            self.speculator.verify(schedule, inputs, logits)
        with self.phases.time("outputs"):
            return self._collect_outputs({item.seq.request_id for item in schedule.scheduled})

    def execute_step(self, proposals: dict[Sequence, list[int]] | None = None
                     ) -> tuple[SchedulerOutput, StepInputs, torch.Tensor] | None:
        """Schedule and run the graph; advance computed-token counts; score prompt logprobs. No sampling.

        `proposals` (speculative tokens) are computed too; they are not counted as computed here.
        The banned tokens of constrained rows are computed while the model runs, into `step_mask`.
        """
        with self.phases.time("schedule"):
            schedule = self.scheduler.schedule(proposals)
        if schedule.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress although requests are waiting")
            return None
        with self.phases.time("schedule"):
            self._move_blocks(schedule)
        with self.phases.time("inputs"):
            inputs = build_step_inputs(schedule.scheduled, self.block_manager.block_size)
            feed = self.runner.prepare(inputs)
            if self.lora is not None:
                feed.tensors[self.lora.token_slots_input] = self.lora.token_slots(schedule.scheduled, self.device,
                                                                                  feed.size)
        pending_mask = self.structured.submit_step(schedule, inputs)
        try:
            with self.phases.time("model"):
                logits = self.runner.execute(feed)
        finally:  # the worker reads the sequences' grammar states: wait for it whatever happened
            with self.phases.time("grammar"):
                self.step_mask = pending_mask.result() if pending_mask is not None else None
        self.last_step = StepRecord(schedule, inputs, logits)
        self.num_steps += 1
        with self.phases.time("bookkeeping"):
            for index, (first_row, count) in inputs.prompt_rows.items():
                seq = schedule.scheduled[index].seq
                self.outputs.add_prompt_logprobs(self.requests[seq.request_id],
                                                 logits[first_row:first_row + count], seq.num_computed_tokens)
            for item in schedule.scheduled:
                item.seq.num_computed_tokens += item.num_real_tokens
                self.block_manager.cache_full_blocks(item.seq)
        return schedule, inputs, logits

    def _move_blocks(self, schedule: SchedulerOutput) -> None:
        """Before the step runs: swap-outs read their blocks first, then copy-on-write, then swap-ins."""
        self.kv_cache.swap_out(schedule.swap_out)
        copies = self.block_manager.take_pending_copies()
        self.kv_cache.copy_blocks([(copy.source, copy.destination) for copy in copies])
        self.kv_cache.swap_in(schedule.swap_in)

    def _fork_siblings(self, seq: Sequence) -> list[Sequence]:
        """Create a request's remaining parallel samples from sample 0, sharing its blocks."""
        request = self.requests.get(seq.request_id)
        if request is None or seq.index != 0 or not request.pending_forks:
            return []
        siblings = []
        for index in range(len(request.sequences), request.params.n):
            sibling = seq.fork(index, _generator(request.params, index))
            self.block_manager.fork(seq, sibling)
            self.scheduler.add_running(sibling)
            request.sequences.append(sibling)
            siblings.append(sibling)
        return siblings

    def _collect_outputs(self, request_ids: set[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in sorted(request_ids, key=lambda rid: self.requests[rid].arrival_time):
            request = self.requests[request_id]
            outputs.append(request.make_output())
            if request.finished:
                del self.requests[request_id]
        return outputs

    def shutdown(self) -> None:
        """Stop the worker ranks of a parallel engine and the structured-output mask thread."""
        self.structured.shutdown()
        if self.parallel is not None:
            self.parallel.shutdown()

    def kv_utilization(self) -> float:
        """Tokens stored / token slots of the blocks in use (1.0 = no slot allocated but unused)."""
        stored, slots = self.kv_slot_counts()
        return stored / slots if slots else 1.0

    def kv_slot_counts(self) -> tuple[int, int]:
        """(tokens stored, token slots) over the distinct blocks the running sequences hold."""
        filled: dict[int, int] = {}
        size = self.block_manager.block_size
        for seq in self.scheduler.running:
            for index, block_id in enumerate(seq.block_table):
                stored = min(size, max(0, seq.num_computed_tokens - index * size))
                filled[block_id] = max(filled.get(block_id, 0), stored)
        return sum(filled.values()), len(filled) * size

    # ---- validation ----

    def _detokenizer(self, token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens,
                                      params.spaces_between_special_tokens)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        try:  # integers only: int() would truncate 1.5 and parse "7"
            token_ids = [operator.index(token) for token in prompt]
        except TypeError:
            raise RequestError(f"a prompt is text or a list of integer token ids, got {_describe(prompt)}") from None
        if not token_ids:
            raise RequestError("the prompt is empty")
        bad = [token for token in token_ids if not 0 <= token < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return None, token_ids

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(token_ids)} tokens, but the model's max_model_len is "
                               f"{self.max_model_len}{self._length_limit_note}; the prompt plus at least one "
                               "generated token must fit")
        params.verify_token_ids(self.vocab_size)


def _describe(prompt) -> str:
    """A prompt that is neither text nor token ids, for an error message: its type, and a list's item types."""
    if isinstance(prompt, (list, tuple)):
        return f"a {type(prompt).__name__} of {', '.join(sorted({type(item).__name__ for item in prompt}))}"
    return f"a {type(prompt).__name__}"


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
    """auto: triton on CUDA (when installed); on CPU the native cpu kernels when they build here, else torch
    (with one warning naming what is missing). An explicit triton or cpu must be able to run there."""
    from octavo.codegen.cpu_backend.kernel_table import cpu_backend_problem
    from octavo.codegen.triton_backend.availability import check_triton_backend

    if backend == "cpu" or (backend == "auto" and device.type == "cpu"):
        problem = "it runs on CPU only" if device.type != "cpu" else cpu_backend_problem()
        if problem is None:
            return "cpu"
        if backend == "cpu":
            raise OctavoError(f"backend cpu cannot run: {problem}")
        _warn_once(f"the native CPU kernels are unavailable, running the slower torch backend: {problem}")
        return "torch"
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


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def artifact_path(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().resolve()
