"""Every command that runs an engine starts its ranks through one launch path (`octavo.parallel.follow`).

eval runs over two nodes of Octavo's own launcher (node 1: `--node-rank 1`,
which only runs its rank) and must score the text as one process does:
float32 log-probabilities over two pipeline stages are computed by the same
kernels on the same values, so the perplexities agree to float32 rounding.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from octavo.cli import main
from tests.serve.server_process import free_port

pytestmark = pytest.mark.usefixtures("one_thread")

EVAL = ["--perplexity", "default", "--max-text-tokens", "96", "--window", "64", "--stride", "32", "--json",
        "--threads", "1"]


def _eval_record(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert main(["eval", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_over_two_nodes_scores_like_one_process(tiny_artifact, capsys):
    artifact = str(tiny_artifact("llama"))
    single = _eval_record(capsys, artifact, *EVAL)
    layout = ["-pp", "2", "--nnodes", "2", "--distributed-init", f"tcp://127.0.0.1:{free_port()}"]
    node1 = subprocess.Popen([sys.executable, "-m", "octavo.cli", "eval", artifact, *EVAL, *layout, "--node-rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        parallel = _eval_record(capsys, artifact, *EVAL, *layout, "--node-rank", "0")
        out, err = node1.communicate(timeout=120)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert node1.returncode == 0, err[-2000:]
    assert "perplexity" not in out  # node 1 runs a rank; node 0 scores and prints
    assert parallel["tokens_sha256"] == single["tokens_sha256"]
    assert parallel["perplexity"] == pytest.approx(single["perplexity"], rel=1e-5)


COMMANDS = [["chat"], ["warmup"], ["eval", "--perplexity", "default"], ["generate", "--prompt", "x"], ["serve"],
            ["bench"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command[0])
def test_every_engine_command_on_another_node_starts_that_node_s_ranks(command, tiny_artifact, capfd):
    """On node 1, each command joins the launch as its ranks do: here it finds no node 0 at the rendezvous."""
    artifact = str(tiny_artifact("llama"))
    capfd.readouterr()
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    assert main([command[0], artifact, *command[1:], "-pp", "2", "--nnodes", "2", "--node-rank", "1",
                 "--distributed-init", f"tcp://{address}", "--rendezvous-timeout", "0.5"]) == 1
    assert f"error: rank 1 could not reach the rendezvous at {address} within 0.5s" in capfd.readouterr().err
