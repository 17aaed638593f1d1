"""Benchmark workloads, read from benchmarks/workloads.toml, or fixed requests read from a JSON file.

The prompts are drawn exactly as the side-by-side harness of the other engines draws them (Python's
`random.Random(seed)`: the shared prefix, then per request a length from `randint(min, max)` and
that many ids from `randrange(token_id_low, token_id_high)`), so that Octavo and every peer run the
same token ids.
"""

from __future__ import annotations

import json
import random
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from octavo.errors import OctavoError

WORKLOADS_FILE = "workloads.toml"


@dataclass(frozen=True)
class Workload:
    """Requests of random token ids: `num_requests` prompts of `prompt_len_min..max` tokens
    (after a common `shared_prefix_len`-token prefix), each generating `output_len` tokens.

    With `chat_file` (a TOML file next to workloads.toml, with [[request]] tables of `instruction`
    and optionally `code`), the prompts are instead real chat requests rendered by the artifact's chat
    template, taken in order (and again from the first when there are more requests than tables).

    With `schema_file` (a JSON schema next to workloads.toml), every request's output is constrained
    to that schema (structured output); it ends when the JSON does, at most `output_len` tokens.
    """

    name: str
    description: str
    num_requests: int
    output_len: int
    prompt_len_min: int = 0
    prompt_len_max: int = 0
    seed: int = 0
    shared_prefix_len: int = 0
    token_id_low: int = 100
    token_id_high: int = 49000
    fixed_prompts: tuple[tuple[int, ...], ...] | None = None
    chat_file: str | None = None
    schema_file: str | None = None

    def schema(self) -> dict | None:
        """The JSON schema every output must match (None: unconstrained)."""
        if self.schema_file is None:
            return None
        return json.loads((workloads_path().parent / self.schema_file).read_text())

    def prompts(self, vocab_size: int, tokenizer=None) -> list[list[int]]:
        """The workload's prompts as token ids (deterministic; ids below `vocab_size`).

        Ids are drawn from [token_id_low, min(token_id_high, vocab_size)): the low ids, where
        tokenizers keep their special tokens, are left out. A chat workload (`chat_file`) renders
        its requests with `tokenizer`'s chat template instead.
        """
        if self.fixed_prompts is not None:
            return self._checked_fixed_prompts(vocab_size)
        if self.chat_file is not None:
            return self._chat_prompts(tokenizer)
        high = min(self.token_id_high, vocab_size)
        if high <= self.token_id_low:
            raise OctavoError(f"workload {self.name}: the vocabulary of {vocab_size} tokens has no id in "
                              f"[{self.token_id_low}, {self.token_id_high})")
        rng = random.Random(self.seed)
        prefix = [rng.randrange(self.token_id_low, high) for _ in range(self.shared_prefix_len)]
        prompts = []
        for _ in range(self.num_requests):
            length = rng.randint(self.prompt_len_min, self.prompt_len_max)
            prompts.append(prefix + [rng.randrange(self.token_id_low, high) for _ in range(length)])
        return prompts

    def _checked_fixed_prompts(self, vocab_size: int) -> list[list[int]]:
        prompts = [list(prompt) for prompt in self.fixed_prompts[:self.num_requests]]
        for index, prompt in enumerate(prompts):
            bad = [token for token in prompt if not 0 <= token < vocab_size]
            if bad:
                raise OctavoError(f"workload {self.name}: request {index} has token id {bad[0]}, outside the "
                                  f"model's vocabulary of {vocab_size}")
        return prompts

    def _chat_prompts(self, tokenizer) -> list[list[int]]:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise OctavoError(f"workload {self.name} is made of chat requests: it needs the artifact's tokenizer "
                              "with a chat template")
        with open(workloads_path().parent / self.chat_file, "rb") as handle:
            requests = tomllib.load(handle)["request"]
        prompts = []
        for index in range(self.num_requests):
            request = requests[index % len(requests)]
            content = request["instruction"]
            if "code" in request:
                content += f"\n\n```python\n{request['code'].strip()}\n```"
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                     add_generation_prompt=True, tokenize=False)
            prompts.append(tokenizer.encode(rendered, add_special_tokens=False))
        return prompts


def workload_from_file(path: str | Path) -> Workload:
    """Fixed requests from a JSON file: a list of {"prompt_token_ids": [...], "max_tokens": N}.

    This is what the side-by-side harness writes (`python workload.py NAME > NAME.json`), so every
    engine runs the very same requests. All requests must ask for the same max_tokens.
    """
    path = Path(path)
    try:
        requests = json.loads(path.read_text())
    except OSError as error:
        raise OctavoError(f"cannot read {path}: {error.strerror}") from error
    except ValueError as error:
        raise OctavoError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(requests, list) or not requests:
        raise OctavoError(f"{path}: expected a non-empty JSON list of requests")
    prompts, lengths = [], set()
    for index, request in enumerate(requests):
        ids = request.get("prompt_token_ids") if isinstance(request, dict) else None
        max_tokens = request.get("max_tokens") if isinstance(request, dict) else None
        if (not isinstance(ids, list) or not ids or not all(isinstance(token, int) for token in ids)
                or not isinstance(max_tokens, int) or max_tokens < 1):
            raise OctavoError(f"{path}: request {index} must be {{\"prompt_token_ids\": [ints], "
                              "\"max_tokens\": positive int}")
        prompts.append(tuple(ids))
        lengths.add(max_tokens)
    if len(lengths) > 1:
        raise OctavoError(f"{path}: requests ask for different max_tokens {sorted(lengths)}; the benchmark "
                          "runs one output length per workload")
    sizes = [len(prompt) for prompt in prompts]
    return Workload(name=path.stem, description=f"{len(prompts)} requests from {path.name}",
                    num_requests=len(prompts), prompt_len_min=min(sizes), prompt_len_max=max(sizes),
                    output_len=lengths.pop(), fixed_prompts=tuple(prompts))


def workloads_path() -> Path:
    """benchmarks/workloads.toml of the source tree, else the copy installed under share/octavo."""
    candidates = [Path(__file__).resolve().parents[2] / "benchmarks" / WORKLOADS_FILE,
                  Path(sys.prefix) / "share" / "octavo" / "benchmarks" / WORKLOADS_FILE]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise OctavoError(f"cannot find {WORKLOADS_FILE}; looked in {', '.join(map(str, candidates))}")


def load_workloads() -> dict[str, Workload]:
    with open(workloads_path(), "rb") as handle:
        table = tomllib.load(handle)
    return {name: Workload(name=name, **fields) for name, fields in table.items()}


def get_workload(name: str) -> Workload:
    workloads = load_workloads()
    if name not in workloads:
        raise OctavoError(f"unknown workload {name!r}; choose one of {', '.join(sorted(workloads))}")
    return workloads[name]
