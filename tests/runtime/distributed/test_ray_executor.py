"""`octavo serve --distributed-executor ray`: worker ranks as Ray actors, on a local Ray cluster of 2 CPU actors.

The server (rank 0) starts a local Ray instance (RAY_ADDRESS=local: never
another cluster of this machine), places ranks 1 and 2 of a tensor-parallel
engine of 3 as actors, and answers like the single-process engine. When an
actor's process is killed, the next request and /health get 503 naming its
rank, and stopping the server leaves no process behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from octavo.llm import LLM
from octavo.runtime.sampling_params import SamplingParams
from tests.serve.server_process import ServerProcess, free_port

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The capital of France is", "Once upon a time"]
MAX_TOKENS = 10


def test_ray_actors_serve_like_one_process_and_a_dead_actor_gives_503_naming_its_rank(tiny_mqa_artifact, tmp_path):
    """6 query heads and 1 KV head over 3 ranks: 2 heads each, the KV head replicated, the vocabulary padded."""
    single = LLM(tiny_mqa_artifact, num_kv_blocks=64, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [output.outputs[0].text for output in single.generate(PROMPTS, params)]
    server = _start_verbose_server(tiny_mqa_artifact, tmp_path, "-tp", "3", "--distributed-executor", "ray",
                                   "--num-kv-blocks", "64", "--collective-timeout", "20", "--threads", "1")
    try:
        processes = [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children(recursive=True)]
        for prompt, text in zip(PROMPTS, expected, strict=True):
            response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text
        actors = {int(rank): int(pid) for rank, pid in re.findall(r"rank (\d+): Ray actor \S+ \(pid (\d+)\)",
                                                                   server.log())}
        assert sorted(actors) == [1, 2]
        psutil.Process(actors[2]).send_signal(signal.SIGKILL)
        time.sleep(1.0)  # Ray reports the actor's death to the engine's watcher
        response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": server.model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS})
        assert response.status_code == 503 and "rank 2 (Ray actor) died" in response.text, response.text
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    finally:
        server.stop()
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, f"left running after the server stopped: {[process.cmdline() for process in alive]}"


def _start_verbose_server(artifact, log_dir, *args: str) -> ServerProcess:
    """`octavo -v serve ...` (the placement of the actors is logged at INFO), once /health answers 200."""
    port = free_port()
    log_path = log_dir / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "octavo.cli", "-v", "serve", str(artifact), "--port",
                                    str(port), "--served-model-name", "m", *args], stdout=log,
                                   stderr=subprocess.STDOUT, env={**os.environ, "RAY_ADDRESS": "local"})
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path, "m")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert process.poll() is None, server.log()[-3000:]
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop(signal.SIGKILL)
    raise AssertionError(f"no /health within 240s:\n{server.log()[-3000:]}")
