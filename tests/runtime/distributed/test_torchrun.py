"""Parallel engines started by torchrun: every rank runs the same command, rank 0 serves or prints.

torchrun (``python -m torch.distributed.run``, the module behind the
`torchrun` command) starts the ranks with RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, and watches them: when one dies it ends
the others and exits non-zero, naming the rank.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from octavo.llm import LLM
from octavo.runtime.sampling_params import SamplingParams
from tests.serve.server_process import free_port

pytestmark = pytest.mark.usefixtures("one_thread")

SMOLLM2_PROMPTS = [
    "The capital of France is",
    "Write a haiku about compilers.",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1969, the first person to walk on the moon was",
    "A good way to learn a new language is",
]
GENERATE = """\
import json
import octavo

llm = octavo.LLM({artifact!r}, tensor_parallel_size={ranks}, num_kv_blocks=256)
params = octavo.SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)
outputs = llm.generate({prompts!r}, params)
print("tokens: " + json.dumps([output.outputs[0].token_ids for output in outputs]), flush=True)
"""
EXIT_WITHIN_S = 30.0


def torchrun(ranks: int, log_dir: Path, *args: str) -> list[str]:
    """The torchrun command; its per-rank log directories go under `log_dir` (by default a temporary directory
    torchrun never removes)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "--log-dir", str(log_dir), *args]


@pytest.mark.slow
def test_three_torchrun_ranks_generate_the_single_process_greedy_tokens(smollm2_fp32_artifact, tmp_path):
    """SmolLM2-135M (9 query heads, 3 KV heads) on 3 ranks of 3 heads and 1 KV head each.

    In float32 the ranks' partial sums differ from the single process's sums
    only by rounding (~1e-6 on the logits), far below the gaps between the top
    tokens of real text, so greedy decoding gives the same tokens. Ranks 1
    and 2 run the same script: their LLM(...) follows rank 0 until it shuts
    the engine down, then ends the process.
    """
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    single = LLM(smollm2_fp32_artifact, num_kv_blocks=256, num_threads=1)
    expected = [output.outputs[0].token_ids for output in single.generate(SMOLLM2_PROMPTS, params)]
    script = tmp_path / "generate.py"
    script.write_text(GENERATE.format(artifact=str(smollm2_fp32_artifact), ranks=3, max_tokens=24,
                                      prompts=SMOLLM2_PROMPTS))
    result = subprocess.run(torchrun(3, tmp_path / "torchrun-logs", str(script)), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    printed = [line for line in result.stdout.splitlines() if line.startswith("tokens: ")]
    assert len(printed) == 1, result.stdout  # rank 0 prints, the others follow
    assert json.loads(printed[0].removeprefix("tokens: ")) == expected


def test_torchrun_serve_answers_like_one_process_and_a_killed_rank_ends_every_process(tiny_artifact, tmp_path,
                                                                                    compiled_cache):
    """The ranks run the default (compiled) executor; the packages of tests/.../test_compiled_ranks.py are reused
    from the session's cache (same artifact, positions, world size and thread count)."""
    artifact = tiny_artifact("llama")
    single = LLM(artifact, num_kv_blocks=64, num_threads=1)
    expected = single.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    port = free_port()
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(torchrun(2, tmp_path / "torchrun-logs", "-m", "octavo.cli", "serve", str(artifact),
                                             "--port", str(port), "--served-model-name", "m", "-tp", "2",
                                             "--num-kv-blocks", "64", "--executor", "compiled", "--threads", "1",
                                             "--grace-period", "5"),
                                    stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_health(url, launcher, log_path)
        response = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "m", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected[0].outputs[0].text

        ranks = {int(child.environ()["RANK"]): child for child in psutil.Process(launcher.pid).children()}
        # The launcher is left to Popen: a psutil wait would reap it, and Popen.wait() would then report 0.
        processes = psutil.Process(launcher.pid).children(recursive=True)
        threading.Timer(1.0, ranks[1].send_signal, (signal.SIGKILL,)).start()
        killed_at = time.monotonic() + 1.0
        try:  # a long request, in flight when rank 1 dies
            response = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "m", "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True})
            assert response.status_code == 503 and "rank 1" in response.text, log_path.read_text()[-4000:]
        except httpx.TransportError:
            pass  # torchrun ended the server first
        _, alive = psutil.wait_procs(processes, timeout=max(0.0, killed_at + EXIT_WITHIN_S - time.monotonic()))
        assert not alive, f"still running {EXIT_WITHIN_S}s after the kill: {alive}"
        assert launcher.wait(timeout=max(1.0, killed_at + EXIT_WITHIN_S - time.monotonic())) != 0, \
            log_path.read_text()[-4000:]
        log = log_path.read_text()
        assert "rank      : 1 (local_rank: 1)" in log and "(SIGKILL)" in log, log[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def _wait_for_health(url: str, launcher: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert launcher.poll() is None, log_path.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"no /health within 240s:\n{log_path.read_text()[-3000:]}")
