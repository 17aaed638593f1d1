"""Tokenization and chat templating on worker threads, off the engine thread and the event loop.

A long prompt takes long to tokenize; on the engine thread it would stall every decode, on the event
loop every other request and /health. The Rust tokenizer behind a Hugging Face fast tokenizer
releases the GIL while it encodes a batch, so worker threads run beside both; `encode` calls it
directly (`encode_batch_fast`: no character offsets, which nothing here needs), which gives the
same ids as `tokenizer.encode` in a fraction of the time and of the GIL. Each worker has its own
copy of the tokenizer: the engine thread keeps detokenizing with the original, and no two threads
ever share one. (The workers keep the normal scheduling priority: a lower one lets the OS leave a
worker that holds the GIL unscheduled while the engine thread waits for it.)
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from octavo.serve.defaults import DEFAULT_WORKERS
from octavo.serve.errors import APIError

T = TypeVar("T")


@dataclass
class EncodedPrompt:
    """A prompt as token ids, with its text for echo and the text of its first token (echo with logprobs)."""

    token_ids: list[int]
    prompt_text: str | None = None
    first_token_text: str = ""


class PromptEncoder:
    """Runs tokenizer work on a small pool of threads, each with its own copy of `tokenizer`.

    The copies are made here, before serving: copying holds the GIL for a while, which would stall
    the event loop if a worker made its copy on its first request.
    """

    def __init__(self, tokenizer: Any, num_workers: int = DEFAULT_WORKERS):
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(num_workers):
            self._copies.put(copy.deepcopy(tokenizer))
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="octavo-tokenizer",
                                        initializer=self._take_copy)

    async def run(self, function: Callable[[Any], T]) -> T:
        """`function(tokenizer)` on a worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: function(self._worker_tokenizer()))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _take_copy(self) -> None:
        self._local.tokenizer = self._copies.get_nowait()

    def _worker_tokenizer(self) -> Any:
        return self._local.tokenizer


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)`, through the Rust tokenizer when there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def encode_prompt(tokenizer: Any, prompt: str | list[int], want_text: bool,
                  add_special_tokens: bool = True) -> EncodedPrompt:
    """Text -> token ids (by default with the tokenizer's special tokens, as LLM.generate encodes); ids pass
    through."""
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt, str):
        token_ids = encode(tokenizer, prompt, add_special_tokens=add_special_tokens)
        text = prompt
    else:
        token_ids = list(prompt)
        text = tokenizer.decode(token_ids) if want_text else None
    first_text = tokenizer.decode(token_ids[:1]) if want_text else ""
    return EncodedPrompt(token_ids, text, first_text)


def render_chat(tokenizer: Any, messages: list[dict], check_text: Callable[[str], None] | None = None, *,
                tools: list[dict] | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, add_special_tokens: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> EncodedPrompt:
    """`messages` (and `tools`) through the chat template, then tokenized.

    By default the assistant turn is opened (as LLM.chat) and no special tokens are added beyond
    those the template writes. `template_kwargs` are extra variables of the template; one named
    like a parameter of `apply_chat_template` itself (tokenize, chat_template, ...) is a 400, as it
    would change how the template is applied rather than what it renders. `check_text` sees the
    rendered text before it is tokenized (and may reject it).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    if add_generation_prompt and continue_final_message:
        raise APIError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                       param="continue_final_message")
    template_kwargs = template_kwargs or {}
    reserved = sorted(set(template_kwargs) & set(inspect.signature(tokenizer.apply_chat_template).parameters))
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: a parameter of the "
                            "template's application, not a variable of the template", param="chat_template_kwargs")
    try:
        rendered = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, tokenize=False,
                                                 **template_kwargs)
    except Exception as error:  # a template may raise anything on messages it does not accept
        raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None
    if check_text is not None:
        check_text(rendered)
    return EncodedPrompt(encode(tokenizer, rendered, add_special_tokens=add_special_tokens))
