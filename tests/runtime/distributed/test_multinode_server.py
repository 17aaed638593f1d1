"""Two `octavo serve` node processes on 127.0.0.1 (pipeline parallel 2: one stage, one rank, per node).

Node 0 serves the OpenAI API; node 1 only runs its ranks. Their completions
must equal the single-process engine's; when a rank of node 1 is killed, the
server answers 503 (the next request and /health) instead of hanging, and
node 1 exits non-zero. A node whose rank cannot even load the artifact stops
node 0's start with that rank's error.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from octavo.config import EngineConfig
from octavo.errors import WorkerFailedError
from octavo.llm import LLM
from octavo.parallel import create_engine
from octavo.runtime.sampling_params import SamplingParams
from tests.serve.server_process import free_port, start_server

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
MAX_TOKENS = 12
TIMEOUT_S = 20.0
ENGINE = ["--num-kv-blocks", "64", "--collective-timeout", str(TIMEOUT_S)]


def test_two_nodes_serve_like_one_process_and_answer_503_when_a_rank_dies(tiny_artifact, tmp_path):
    artifact = tiny_artifact("mistral")
    reference = LLM(artifact, num_kv_blocks=64, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [output.outputs[0].text for output in reference.generate(PROMPTS, params)]

    layout = ["-pp", "2", "--nnodes", "2", "--distributed-init", f"tcp://127.0.0.1:{free_port()}"]
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "octavo.cli", "serve", str(artifact), *layout, *ENGINE,
                                  "--node-rank", "1", "--threads", "1"], stdout=log, stderr=subprocess.STDOUT)
    server = None
    try:
        server = start_server(artifact, tmp_path, *layout, *ENGINE, "--node-rank", "0")
        for prompt, text in zip(PROMPTS, expected, strict=True):
            response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text

        victim = max(psutil.Process(node1.pid).children(), key=lambda child: child.pid)
        victim.send_signal(signal.SIGKILL)
        start = time.monotonic()
        response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": server.model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS})
        assert response.status_code == 503, response.text
        assert time.monotonic() - start < TIMEOUT_S + 5
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
        assert node1.wait(timeout=TIMEOUT_S + 10) != 0
        assert "was killed by signal SIGKILL" in server.log()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        if server is not None:
            server.stop()


def test_a_rank_that_cannot_load_stops_the_start_with_its_error(tiny_artifact, tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    missing = tmp_path / "not-copied-to-node-1"
    node1 = subprocess.Popen([sys.executable, "-m", "octavo.cli", "serve", str(missing), "-tp", "2", "--nnodes", "2",
                              "--node-rank", "1", "--distributed-init", init, "--threads", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        config = EngineConfig(num_kv_blocks=16, num_threads=1, tensor_parallel_size=2, nnodes=2, node_rank=0,
                              distributed_init=init)
        with pytest.raises(WorkerFailedError, match=f"rank 1 failed: ArtifactError: no such artifact directory: "
                                                    f"{missing}"):
            create_engine(tiny_artifact("llama"), config)
        rc = node1.wait(timeout=60)
        assert rc == 1, node1.stderr.read().decode()[-4000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
