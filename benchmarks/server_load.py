"""`octavo serve` under load on 127.0.0.1: memory with slow readers, /health, blocks, and tokenization stalls.

    python benchmarks/server_load.py [--artifact DIR] [--work-dir DIR]

Without --artifact, a tiny random-weight llama (2 layers, hidden 64, the bundled SmolLM2 tokenizer,
max_position_embeddings 8192) is built and compiled into the work directory once; the serving
machinery, not the model, is what is measured. Three runs, each against a fresh server process:

1. 256 concurrent streams: 32 disconnect after 5 events, 64 get 1000 tokens, 160 get 200 tokens;
   everyone reads at once: the reference peak RSS.
2. The same with the 64 long streams read slowly (a 64 KiB receive buffer, one event per second,
   until the server has generated everything): peak RSS against run 1.
   Both runs poll /health every 100 ms (every answer must come within 1 s) and end with every KV
   block free or merely cached (/metrics).
3. 64 streams decoding; in windows that alternate with quiet ones (3 rounds), a client (--senders)
   sends prompts of exactly max_model_len tokens back to back: each is tokenized in full and then
   refused (prompt and output cannot fit). The streams' inter-token p99 over those windows must stay
   within 2x of the quiet windows'. The same with the longest text the character bound lets reach
   the tokenizer ((max_model_len - 1) x 81 characters: about 370k tokens of random words), reported.

Peak RSS is the server's VmHWM from /proc. Timings on a shared machine are indicative only. Exits 1
if a check fails. The bounds on counts and times (--timeout per run) keep it finite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

NUM_STREAMS = 256
NUM_SLOW = 64
NUM_DISCONNECTING = 32
STREAM_TOKENS = 200
LONG_STREAM_TOKENS = 1000
SLOW_READ_PAUSE_S = 1.0
HEALTH_PERIOD_S = 0.1
HEALTH_LIMIT_S = 1.0
ITL_STREAMS = 64
ITL_STREAM_TOKENS = 4000
ITL_ROUNDS = 3
ITL_KV_BLOCKS = 16384  # 64 streams x 4000 tokens fit without preemption
LONGEST_TOKEN = "\n" + " " * 80  # one token of the bundled tokenizer: 81 characters, the most any token has
TINY_MAX_MODEL_LEN = 8192
THREADS = 1  # torch threads of the server: a tiny model gains nothing from more, and they fight on a busy machine


def build_tiny_artifact(work_dir: Path) -> Path:
    """A tiny random-weight llama with the bundled tokenizer, compiled once into `work_dir`."""
    artifact = work_dir / "tiny-llama-8k.octavo"
    if (artifact / "manifest.json").exists():
        return artifact
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from octavo.compiler import compile_model
    from octavo.frontend import load_model

    source = work_dir / "tiny-llama-8k"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_MAX_MODEL_LEN,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(source)
    load_model("smollm2-135m").tokenizer.save_pretrained(source)
    return compile_model(source, artifact)


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log: Path

    def peak_rss_mib(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "")] = float(value)
        return values


@contextlib.contextmanager
def running_server(artifact: Path, log_dir: Path, *extra: str):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = log_dir / f"serve-{port}.log"
    command = [sys.executable, "-m", "octavo.cli", "serve", str(artifact), "--port", str(port),
               "--served-model-name", "m", "--threads", str(THREADS), *extra]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    server = Server(process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.25)
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


class HealthProbe(threading.Thread):
    """Polls /health from its own thread; records the slowest answer and any failure."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stopped.is_set():
                start = time.monotonic()
                try:
                    status = client.get(f"{self.url}/health").status_code
                    if status != 200:
                        self.failures.append(f"status {status}")
                except httpx.HTTPError as error:
                    self.failures.append(repr(error))
                self.latencies.append(time.monotonic() - start)
                self.stopped.wait(HEALTH_PERIOD_S)


@dataclass
class StreamResult:
    status: int = 0
    events: int = 0
    error: str | None = None
    token_times: list[float] = field(default_factory=list)


async def stream(client: httpx.AsyncClient, url: str, body: dict, stop_after: int | None = None,
                 pause_s: float = 0.0, until: asyncio.Event | None = None) -> StreamResult:
    """One streaming completion; `stop_after` events then disconnect; `pause_s` after every read;
    `until` set: disconnect at the next read."""
    result = StreamResult()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.error = (await response.aread()).decode(errors="replace")[:200]
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line.removeprefix("data: "))
            if "error" in payload:
                result.error = payload["error"]["message"]
                continue
            result.events += 1
            result.token_times.append(time.monotonic())
            if (stop_after is not None and result.events >= stop_after) or (until is not None and until.is_set()):
                break
            if pause_s:
                await asyncio.sleep(pause_s)
    return result


def body(index: int, max_tokens: int) -> dict:
    # Greedy: the sampler's cost would only slow the run down; the serving machinery is what is measured.
    return {"model": "m", "prompt": f"Request {index}: a long story about rivers and compilers", "stream": True,
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def generation_done(server: Server, done: asyncio.Event) -> None:
    """Set `done` once the server has generated everything (nothing running or waiting)."""
    await asyncio.sleep(2.0)
    while True:
        metrics = await asyncio.to_thread(server.metrics)
        if metrics["octavo_num_requests_running"] == metrics["octavo_num_requests_waiting"] == 0:
            done.set()
            return
        await asyncio.sleep(0.5)


async def load_run(server: Server, slow_readers: bool, timeout_s: float) -> list[StreamResult]:
    """256 streams: 32 leave after 5 events, 64 get long outputs (read slowly, or at once), the rest short ones.

    Slow readers read one event per SLOW_READ_PAUSE_S through a 64 KiB receive buffer, and leave
    once the server has generated everything: by then the server has held the most for them.
    """
    done = asyncio.Event()
    fast = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=NUM_STREAMS + 8))
    slow = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=NUM_SLOW + 8),
                             transport=httpx.AsyncHTTPTransport(
                                 socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)]))
    async with fast, slow:
        tasks = []
        for index in range(NUM_STREAMS):
            if index < NUM_DISCONNECTING:
                tasks.append(stream(fast, server.url, body(index, STREAM_TOKENS), stop_after=5))
            elif index < NUM_DISCONNECTING + NUM_SLOW:
                long_body = body(index, LONG_STREAM_TOKENS)
                tasks.append(stream(slow, server.url, long_body, pause_s=SLOW_READ_PAUSE_S, until=done)
                             if slow_readers else stream(fast, server.url, long_body))
            else:
                tasks.append(stream(fast, server.url, body(index, STREAM_TOKENS)))
        monitor = asyncio.ensure_future(generation_done(server, done))
        try:
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)  # bounded in time
        finally:
            monitor.cancel()


def wait_idle(server: Server, timeout_s: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        idle = (metrics["octavo_num_requests_running"] == metrics["octavo_num_requests_waiting"] == 0
                and metrics["octavo_kv_blocks_used"] == 0)
        if idle or time.monotonic() > deadline:
            return metrics


def memory_run(artifact: Path, log_dir: Path, slow_readers: bool, timeout_s: float) -> dict:
    with running_server(artifact, log_dir, "--num-kv-blocks", "8192") as server:
        probe = HealthProbe(server.url)
        probe.start()
        started = time.monotonic()
        results = asyncio.run(load_run(server, slow_readers, timeout_s))
        elapsed = time.monotonic() - started
        probe.stopped.set()
        probe.join()
        metrics = wait_idle(server)
        return {"peak_rss_mib": server.peak_rss_mib(), "elapsed_s": elapsed,
                "health_max_s": max(probe.latencies), "health_polls": len(probe.latencies),
                "health_failures": probe.failures, "statuses": sorted({result.status for result in results}),
                "errors": sum(result.error is not None for result in results),
                "events": sum(result.events for result in results),
                "kv_blocks_used_after": metrics["octavo_kv_blocks_used"],
                "requests_left": metrics["octavo_num_requests_running"] + metrics["octavo_num_requests_waiting"]}


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else float("nan")


async def send_while(client: httpx.AsyncClient, url: str, prompt: str, until: float) -> list[tuple[int, str]]:
    """Send `prompt` again and again until `until`; each answer's status and the start of its message."""
    answers = []
    while time.monotonic() < until:
        response = await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
        answers.append((response.status_code, response.json().get("error", {}).get("message", "")[:100]))
    return answers


async def itl_run(server: Server, prompts: dict[str, str], timeout_s: float, window_s: float,
                  num_senders: int, rounds: int) -> dict:
    """Inter-token gaps of 64 decoding streams in quiet windows and while each kind of prompt is sent.

    The windows alternate (quiet, then each kind of prompt) for `rounds` rounds, so that a change in
    the machine's load during the run weighs on all of them alike.
    """
    limits = httpx.Limits(max_connections=ITL_STREAMS + 8)
    windows: dict[str, list[tuple[float, float]]] = {"quiet": [], **{name: [] for name in prompts}}
    answers: dict[str, set] = {name: set() for name in prompts}
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        stop = asyncio.Event()
        streams = [asyncio.ensure_future(stream(client, server.url, body(index, ITL_STREAM_TOKENS), until=stop))
                   for index in range(ITL_STREAMS)]
        await asyncio.sleep(window_s)  # every stream has started
        for _ in range(rounds):
            start = time.monotonic()
            await asyncio.sleep(window_s)
            windows["quiet"].append((start, time.monotonic()))
            for name, prompt in prompts.items():
                start = time.monotonic()
                senders = [send_while(client, server.url, prompt, start + window_s) for _ in range(num_senders)]
                answers[name].update(answer for sent in await asyncio.gather(*senders) for answer in sent)
                windows[name].append((start, time.monotonic()))
        stop.set()
        results = await asyncio.gather(*streams)
    gaps = {name: [] for name in windows}
    for result in results:
        for previous, current in zip(result.token_times, result.token_times[1:], strict=False):
            for name, spans in windows.items():
                if any(start <= previous and current <= end for start, end in spans):
                    gaps[name].append(current - previous)
    return {name: {"gaps": len(values), "p99_ms": round(1000 * p99(values), 1),
                   "answers": sorted(answers.get(name, []))} for name, values in gaps.items()}


def long_prompts() -> dict[str, str]:
    """Prompts of random words (a tokenizer's cache does not help with them): one of exactly
    max_model_len tokens (with max_tokens 1 it cannot fit, so it is refused after tokenizing), and the
    longest text the character bound lets through to the tokenizer ((max_model_len - 1) x 81 characters)."""
    from octavo.frontend import load_model

    tokenizer = load_model("smollm2-135m").tokenizer
    rng = random.Random(0)
    words = []
    while sum(map(len, words)) + len(words) < TINY_MAX_MODEL_LEN * len(LONGEST_TOKEN):
        words.append("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randrange(3, 9))))
    text = " ".join(words)
    low, high = 1, len(text)  # the shortest prefix of TINY_MAX_MODEL_LEN tokens
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.encode(text[:middle])) < TINY_MAX_MODEL_LEN:
            low = middle + 1
        else:
            high = middle
    exact = text[:low]
    assert len(tokenizer.encode(exact)) == TINY_MAX_MODEL_LEN, len(tokenizer.encode(exact))
    return {"max_model_len_tokens": exact, "bound_chars": text[:(TINY_MAX_MODEL_LEN - 1) * len(LONGEST_TOKEN)]}


def report(line: str) -> None:
    print(line, flush=True)  # progress shows while the runs go on


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=None, help="artifact to serve (default: a tiny llama)")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "octavo-server-load")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each run may take at most")
    parser.add_argument("--window", type=float, default=3.0, help="seconds of each measuring window of run 3")
    parser.add_argument("--runs", default="1,2,3", help="which runs, e.g. 3 (default 1,2,3)")
    parser.add_argument("--senders", type=int, default=1, help="clients sending the long prompts in run 3")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    artifact = args.artifact or build_tiny_artifact(args.work_dir)
    failures = []
    runs = {int(run) for run in args.runs.split(",")}
    if runs & {1, 2}:
        failures += memory_runs(artifact, args.work_dir, args.timeout)
    if 3 in runs:
        failures += itl_check(artifact, args.work_dir, args.timeout, args.window, args.senders)
    for failure in failures:
        report(f"FAILED {failure}")
    return 1 if failures else 0


def memory_runs(artifact: Path, work_dir: Path, timeout_s: float) -> list[str]:
    """Runs 1 and 2; the failed checks."""
    reference = memory_run(artifact, work_dir, False, timeout_s)
    report(f"run 1: {NUM_STREAMS} streams, {NUM_DISCONNECTING} disconnecting, no slow readers: {json.dumps(reference)}")
    slow = memory_run(artifact, work_dir, True, timeout_s)
    report(f"run 2: {NUM_STREAMS} streams, {NUM_DISCONNECTING} disconnecting, {NUM_SLOW} slow readers: "
           f"{json.dumps(slow)}")
    report(f"peak RSS: {slow['peak_rss_mib']:.0f} MiB with slow readers, {reference['peak_rss_mib']:.0f} MiB without "
           f"({slow['peak_rss_mib'] / reference['peak_rss_mib']:.2f}x)")
    failures = []
    for name, run in (("run 1", reference), ("run 2", slow)):
        if run["health_max_s"] >= HEALTH_LIMIT_S or run["health_failures"]:
            failures.append(f"{name}: /health slowest {run['health_max_s']:.2f}s, failures {run['health_failures']}")
        if run["kv_blocks_used_after"] or run["requests_left"]:
            failures.append(f"{name}: blocks or requests left after the run")
        if run["statuses"] != [200] or run["errors"]:
            failures.append(f"{name}: statuses {run['statuses']}, {run['errors']} streams ended with an error")
    return failures


def itl_check(artifact: Path, work_dir: Path, timeout_s: float, window_s: float, num_senders: int) -> list[str]:
    """Run 3; the failed checks."""
    prompts = long_prompts()
    with running_server(artifact, work_dir, "--num-kv-blocks", str(ITL_KV_BLOCKS)) as server:
        itl = asyncio.run(itl_run(server, prompts, timeout_s, window_s, num_senders, ITL_ROUNDS))
    report(f"run 3: {ITL_STREAMS} streams decoding; then prompts sent back to back by {num_senders} client(s): "
           f"{json.dumps(itl)}")
    quiet = itl["quiet"]["p99_ms"]
    for name in prompts:
        report(f"inter-token p99: {itl[name]['p99_ms']:.1f} ms while {name} prompts are tokenized, {quiet:.1f} ms "
               f"quiet ({itl[name]['p99_ms'] / quiet:.2f}x)")
    if not itl["max_model_len_tokens"]["p99_ms"] <= 2 * quiet:
        return ["run 3: inter-token p99 more than doubled while max_model_len prompts were tokenized"]
    return []


if __name__ == "__main__":
    sys.exit(main())
