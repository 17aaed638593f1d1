"""Worker ranks are processes of their own that never import the user's program.

A script that builds `LLM(tensor_parallel_size=2)` at top level, without a
main guard, and the same code fed on stdin must both run: the workers start
as ``python -m octavo.parallel.worker`` and import Octavo only. Their greedy
tokens must equal the single-process engine's (float32, two ranks: the
partial sums of a row-parallel linear add exactly, see
tests/passes/test_shard_tensor_parallel.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from octavo.llm import LLM
from octavo.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 8
PROGRAM = """\
import json
import octavo

llm = octavo.LLM({artifact!r}, tensor_parallel_size=2, num_kv_blocks=32, num_threads=1)
params = octavo.SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)
print(json.dumps([output.outputs[0].token_ids for output in llm.generate({prompts!r}, params)]))
"""


@pytest.fixture(scope="module")
def expected_tokens(tiny_artifact) -> list[list[int]]:
    llm = LLM(tiny_artifact("llama"), num_kv_blocks=32, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("how", ["script without a main guard", "stdin"])
def test_a_top_level_program_starts_two_ranks(how, tiny_artifact, expected_tokens, tmp_path):
    program = PROGRAM.format(artifact=str(tiny_artifact("llama")), max_tokens=MAX_TOKENS, prompts=PROMPTS)
    if how == "stdin":
        command, stdin = [sys.executable, "-"], program
    else:
        (tmp_path / "generate.py").write_text(program)
        command, stdin = [sys.executable, str(tmp_path / "generate.py")], None
    result = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected_tokens
