"""LLM: the offline Python API (vLLM-style): load or compile, then generate, stream or chat."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from octavo.config import CompileConfig, EngineConfig
from octavo.errors import OctavoError, RequestError
from octavo.ir.artifact_format import MANIFEST
from octavo.parallel import create_engine, follow
from octavo.runtime.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from octavo.runtime.outputs import RequestOutput
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.structured.spec import StructuredOutputs

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


class LLM:
    """Generate from a compiled artifact.

    `model` is an artifact directory, or a model source (bundled name, HF
    directory, .gguf file) that is compiled once into the compile cache with
    `dtype`. Engine options (max_num_seqs, kv_cache_memory, ...) are keyword
    arguments, as in EngineConfig.

    With tensor_parallel_size or pipeline_parallel_size > 1 this process is
    rank 0: it starts the other ranks as processes of their own (they never
    import the calling program), or, when torchrun or srun started this
    process as one of the ranks, joins them. On a rank other than 0 of such a
    launch, the constructor runs the rank until rank 0 shuts the engine down
    and then ends the process (SystemExit): rank 0 generates, the others follow.
    """

    def __init__(self, model: str | os.PathLike, *, dtype: str = "auto", **engine_options):
        path = Path(model).expanduser()
        if not (path / MANIFEST).is_file():
            from octavo.compile_cache import cached_artifact

            path = cached_artifact(model, CompileConfig(dtype=dtype))
        self.artifact_path = path
        config = EngineConfig.from_kwargs(**engine_options)
        follower_exit = follow(path, config)
        if follower_exit is not None:
            raise SystemExit(follower_exit)
        self.engine = create_engine(path, config)
        self._ids = itertools.count()
        self._active: str | None = None

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        """One generate/stream/beam_search at a time: they all step the same engine."""
        if self._active is not None:
            raise OctavoError(f"cannot {what} while {self._active} is in progress on this LLM "
                              "(finish or close the open stream first)")
        self._active = what
        try:
            yield
        finally:
            self._active = None

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (tensor/pipeline parallel size > 1); else nothing."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The artifact's tokenizer (the `tokenizer` property, under vLLM's name for it)."""
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = False, lora: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs in prompt order.

        `lora` names a loaded LoRA adapter (an artifact compiled with LoRA; `lora_modules=("name=path",)`).

        A prompt is text, a list of token ids, or {"prompt_token_ids": [...]}.
        A request that is invalid (too long, say) does not stop the others:
        its output has `error` set and no completions.
        """
        with self._exclusive("generate"):
            return self._generate(prompts, sampling_params, use_tqdm, lora)

    def _generate(self, prompts, sampling_params, use_tqdm: bool, lora: str | None = None) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        outputs: dict[str, RequestOutput] = {}
        order = []
        for prompt, params in zip(prompt_list, params_list, strict=True):
            request_id = f"generate-{next(self._ids)}"
            order.append(request_id)
            rejected = self._add(request_id, prompt, params, lora)
            if rejected is not None:
                outputs[request_id] = rejected
        with tqdm(total=len(order), disable=not use_tqdm, desc="generating", unit="req") as progress:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        outputs[output.request_id] = output
                        progress.update(1)
        return [outputs[request_id] for request_id in order]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it; read `delta_text` for new text.

        While the stream is open, this LLM runs nothing else (closing the
        iterator early aborts the request).
        """
        with self._exclusive("stream"):
            request_id = f"stream-{next(self._ids)}"
            rejected = self._add(request_id, prompt, sampling_params or SamplingParams())
            if rejected is not None:
                yield rejected
                return
            try:
                while True:
                    for output in self.engine.step():
                        if output.request_id == request_id:
                            yield output
                            if output.finished:
                                return
            finally:
                self.engine.abort_request(request_id)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], beam_width: int | BeamSearchParams,
                    max_tokens: int | None = None, *, ignore_eos: bool = False,
                    length_penalty: float = 1.0, structured: StructuredOutputs | dict | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's semantics, see octavo.runtime.beam_search); one output per prompt, best first.

        `structured` keeps every beam inside a grammar (see SamplingParams.structured)."""
        params = beam_width if isinstance(beam_width, BeamSearchParams) else BeamSearchParams(
            beam_width, max_tokens if max_tokens is not None else 16, ignore_eos, length_penalty, structured)
        token_prompts = []
        for prompt in _as_prompt_list(prompts):
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
            token_prompts.append(self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt))
        with self._exclusive("beam_search"):
            return beam_search(self.engine, token_prompts, params)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             **generate_options) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the artifact's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params, **generate_options)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` rendered by the chat template, with the assistant turn opened."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise OctavoError("this artifact's tokenizer has no chat template")
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def _add(self, request_id: str, prompt: PromptType, params: SamplingParams,
             lora: str | None = None) -> RequestOutput | None:
        try:
            if isinstance(prompt, dict):
                prompt = _prompt_of(prompt)
            self.engine.add_request(prompt, params, request_id=request_id, lora=lora)
        except OctavoError as error:
            # Reported to the caller in the output's `error`; a warning here would say it twice.
            logger.info("request %s rejected: %s", request_id, error)
            return RequestOutput(request_id, prompt if isinstance(prompt, str) else None,
                                 list(prompt) if isinstance(prompt, list | tuple) else [], [], True,
                                 error=str(error))
        return None


def _prompt_of(prompt: dict) -> str | list[int]:
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    if "prompt" in prompt:
        return prompt["prompt"]
    raise RequestError(f"a prompt dict needs a 'prompt' or 'prompt_token_ids' key, got keys {sorted(prompt)}")


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Iterable):
        raise TypeError(f"prompts are text, a list of token ids, a dict with 'prompt' or 'prompt_token_ids', or a "
                        f"list of these; got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(isinstance(item, int) for item in prompts):
        return [prompts]
    return prompts


def _broadcast_params(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise OctavoError(f"got {len(params)} sampling params for {count} prompts")
    return params
