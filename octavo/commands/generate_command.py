"""`octavo generate`, `octavo chat` and `octavo demo`: stream text from an artifact."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from octavo.commands.common import add_engine_arguments, console, engine_config, error_console, follow_engine
from octavo.errors import RequestError
from octavo.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from octavo.llm import LLM

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about compilers.",
    "Give me three tips for writing readable Python code.",
]


def add_parsers(subparsers) -> None:
    generate = subparsers.add_parser("generate", help="generate text from an artifact")
    generate.add_argument("artifact", help="artifact directory (or a model source, compiled into the cache)")
    generate.add_argument("--prompt", required=True, help="the prompt text")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _add_sampling_arguments(generate)
    add_engine_arguments(generate)
    generate.set_defaults(run=run_generate)

    chat = subparsers.add_parser("chat", help="chat interactively with an artifact")
    chat.add_argument("artifact", help="artifact directory (or a model source)")
    chat.add_argument("--system", help="system prompt")
    _add_sampling_arguments(chat)
    add_engine_arguments(chat)
    chat.set_defaults(run=run_chat)

    demo = subparsers.add_parser("demo", help="compile the bundled model (cached) and answer a few chat prompts")
    demo.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                      help="auto (default): bf16 where this CPU computes it natively, else float32")
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.set_defaults(run=run_demo)


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def run_generate(args: argparse.Namespace) -> int:
    follower_exit = follow_engine(args)
    if follower_exit is not None:
        return follower_exit
    llm = _load(args.artifact, **_config_kwargs(args))
    try:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        stream_reply(llm, prompt, _sampling(args))
    finally:
        llm.shutdown()  # a parallel engine's other ranks (other nodes' too) end with it
    return 0


def run_chat(args: argparse.Namespace) -> int:
    follower_exit = follow_engine(args)
    if follower_exit is not None:
        return follower_exit
    llm = _load(args.artifact, **_config_kwargs(args))
    try:
        _chat(llm, args)
    finally:
        llm.shutdown()  # a parallel engine's other ranks (other nodes' too) end with it
    return 0


def _chat(llm: LLM, args: argparse.Namespace) -> None:
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    error_console.print("chat: type a message; /clear starts over; /exit, an empty line or Ctrl-D quits")
    while True:
        try:
            text = console.input("[bold]> [/bold]")
        except EOFError:
            break
        command = text.strip()
        if not command or command in ("/exit", "/quit", "/bye"):
            break
        if command == "/clear":
            messages = list(opening)
            error_console.print("(conversation cleared)")
            continue
        messages.append({"role": "user", "content": text})
        try:
            reply = stream_reply(llm, llm.apply_chat_template(messages), _sampling(args))
        except RequestError as error:
            # The conversation goes on without the message that could not be answered.
            print(f"error: {error}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})


def run_demo(args: argparse.Namespace) -> int:
    from octavo.compile_cache import cached_artifact
    from octavo.config import CompileConfig

    with console.status("preparing the bundled SmolLM2-135M artifact (compiled once, then cached)") as status:
        path = cached_artifact("smollm2-135m", CompileConfig(dtype=args.dtype, progress=True),
                               on_stage=lambda message: status.update(message))
    console.print(f"artifact: {path}")
    llm = _load(path)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for prompt in DEMO_PROMPTS:
        console.print(f"\n[bold]user:[/bold] {prompt}\n[bold]assistant:[/bold] ", end="")
        stream_reply(llm, llm.apply_chat_template([{"role": "user", "content": prompt}]), params)
    return 0


def stream_reply(llm: LLM, prompt, params: SamplingParams) -> str:
    """Print the reply as it is generated, then its token count and speed; returns the text.

    A rejected request (prompt too long, say) raises RequestError before anything is printed.
    """
    start = time.perf_counter()
    first_token_at = None
    output = None
    for output in llm.stream(prompt, params):
        if output.error:
            raise RequestError(output.error)
        delta = output.outputs[0].delta_text
        if delta and first_token_at is None:
            first_token_at = time.perf_counter()
        console.out(delta, end="", highlight=False)
    elapsed = time.perf_counter() - start
    completion = output.outputs[0]
    tokens = len(completion.token_ids)
    console.out("")
    console.file.flush()
    error_console.print(f"[dim]({tokens} tokens in {elapsed:.2f}s, {tokens / elapsed:.1f} tok/s, "
                        f"finish: {completion.finish_reason})[/dim]")
    return completion.text


def _load(artifact, **options) -> LLM:
    from octavo.llm import LLM  # here, not at the top: the parser of every command imports this module

    return LLM(artifact, **options)


def _config_kwargs(args: argparse.Namespace) -> dict:
    config = engine_config(args)
    defaults = type(config)()
    return {name: getattr(config, name) for name in vars(config)
            if getattr(config, name) != getattr(defaults, name)}
