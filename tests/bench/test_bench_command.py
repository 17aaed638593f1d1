"""`octavo bench` offline, run as a user runs it, on a tiny random-weight Llama with a 1024-token context.

Each comparison runs the same requests twice in one process; greedy outputs must be identical on both
sides, and the printed figures must say what the comparison is about (cache hits, preemptions).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from octavo.compiler import compile_model
from octavo.config import CompileConfig
from tests.conftest import run_cli
from tests.tiny_models import tiny_config

FUSION_PASSES = "fuse_rms_norm,fuse_add_rms_norm,fuse_qkv,fuse_gate_up,fuse_activation,fuse_rope,fuse_pointwise"


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory, tokenizer_dir) -> Path:
    """The tiny Llama with room for every workload (prompt + output up to 640 tokens)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.max_position_embeddings = 1024
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.08)
    directory = tmp_path_factory.mktemp("tiny-long")
    model.save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory / file.name)
    return directory


@pytest.fixture(scope="module")
def long_context_artifact(long_context_model, tmp_path_factory) -> Path:
    return compile_model(long_context_model, tmp_path_factory.mktemp("tiny-long-artifact") / "artifact",
                         CompileConfig(dtype="float32"))


def bench(*args: str, stderr: list[str] | None = None) -> str:
    result = run_cli("bench", *args)
    assert result.returncode == 0, result.stderr
    if stderr is not None:
        stderr.append(result.stderr)
    return result.stdout


def engine_line(output: str, engine: str) -> str:
    return next(line for line in output.splitlines() if line.strip().startswith(f"{engine} "))


def identical(output: str) -> tuple[int, int]:
    same, total = re.search(r"identical greedy outputs (\d+)/(\d+)", output).groups()
    return int(same), int(total)


def figures(line: str) -> tuple[int, float, float]:
    """(output tokens, seconds, output tok/s) of an engine line."""
    tokens, seconds, rate = re.search(r"\+ (\d+) output tokens in ([0-9.]+)s = ([0-9.]+) output tok/s", line).groups()
    return int(tokens), float(seconds), float(rate)


def test_single_versus_hugging_face(long_context_model, long_context_artifact):
    stderr: list[str] = []
    output = bench(str(long_context_artifact), "--workload", "single", "--vs", "hf", stderr=stderr)
    # The baseline is Hugging Face's own model, loaded from the source the artifact was compiled from.
    assert re.search(rf"loading Hugging Face model .*{long_context_model.name}.* \(float32\) for the baseline",
                     " ".join(stderr[0].split())), stderr[0]
    ours, theirs = engine_line(output, "octavo"), engine_line(output, "hf")
    assert "octavo single: 1 req, 256 prompt + 128 output tokens" in ours
    assert "hf single: 1 req, 256 prompt + 128 output tokens" in theirs
    # Each rate is its tokens over its seconds, and the ratio is the quotient of the rates, up to the
    # printed rounding (seconds and rates to 0.05, the ratio to 0.005).
    for line in (ours, theirs):
        tokens, seconds, rate = figures(line)
        assert tokens / (rate + 0.05) <= seconds + 0.05 and tokens / (rate - 0.05) >= seconds - 0.05, line
    ratio = float(re.search(r"ratio single: octavo/hf output tok/s = (\d+\.\d\d)x", output).group(1))
    (_, _, ours_rate), (_, _, hf_rate) = figures(ours), figures(theirs)
    assert (ours_rate - 0.05) / (hf_rate + 0.05) - 0.005 <= ratio <= (ours_rate + 0.05) / (hf_rate - 0.05) + 0.005
    # Hugging Face's greedy tokens (generate, run by the command) equal Octavo's for the one request.
    assert identical(output) == (1, 1)


def test_shared_prefix_hits_the_cache_and_changes_no_output(long_context_artifact):
    output = bench(str(long_context_artifact), "--workload", "shared_prefix", "--num-requests", "6",
                   "--vs", "no-prefix-caching")
    cached, uncached = engine_line(output, "octavo"), engine_line(output, "no-prefix-caching")
    # 5 of the 6 requests reuse the 384-token prefix (24 blocks of 16).
    assert int(re.search(r"prefix-cache hit tokens (\d+)", cached).group(1)) >= 5 * 384
    assert "prefix-cache hit tokens 0" in uncached
    assert identical(output) == (6, 6)


def test_a_quarter_of_the_pool_preempts_and_changes_no_output(long_context_artifact):
    output = bench(str(long_context_artifact), "--workload", "throughput", "--num-requests", "8",
                   "--kv-pool-fraction", "0.25", "--vs", "full-pool")
    assert "= 25% of the" in output.splitlines()[0]
    assert int(re.search(r"preemptions (\d+)", engine_line(output, "octavo")).group(1)) > 0
    assert "preemptions 0" in engine_line(output, "full-pool")
    assert identical(output) == (8, 8)


def test_fused_versus_unfused_artifact(long_context_model, long_context_artifact, tmp_path):
    unfused = compile_model(long_context_model, tmp_path / "unfused",
                            CompileConfig(dtype="float32", disabled_passes=tuple(FUSION_PASSES.split(","))))
    output = bench(str(long_context_artifact), "--workload", "single", "--vs-artifact", str(unfused))
    assert f"octavo[{unfused}] single: 1 req" in output
    assert identical(output) == (1, 1)


def test_profile_splits_decode_and_prefill_steps(long_context_artifact):
    """`bench --profile` splits each scenario's step by phase and its model time by op kind."""
    output = bench(str(long_context_artifact), "--profile", "--num-kv-blocks", "2700")
    scenarios = re.findall(r"^(decode, 1 sequence|decode, 64 sequences|prefill, 512 tokens): step ([\d.]+) ms .*"
                           r"host work ([\d.]+) ms", output, re.MULTILINE)
    assert [name for name, _, _ in scenarios] == ["decode, 1 sequence", "decode, 64 sequences",
                                                 "prefill, 512 tokens"], output
    assert all(float(host) < float(step) for _, step, host in scenarios)
    phase_lines = [line for line in output.splitlines() if line.strip().startswith("phases:")]
    assert len(phase_lines) == 3 and all("model" in line and "detokenize" in line for line in phase_lines)
    model_lines = [line for line in output.splitlines() if "model under torch.profiler" in line]
    assert len(model_lines) == 3
    for line in model_lines:  # the graph's linears and its paged-attention op are found among the profiled ops
        shares = dict(re.findall(r"(linears|attention|other kernels|graph dispatch) [\d.]+ ms \(([\d.]+)%\)", line))
        assert float(shares["linears"]) > 0 and float(shares["attention"]) > 0, line


def test_profile_of_two_ranks_names_the_collectives_and_exits_cleanly(long_context_artifact):
    """With two tensor-parallel ranks each profiled step's split has its collectives, and the command exits 0 (a
    step's send that began under the profiler and completed after it once corrupted the heap)."""
    output = bench(str(long_context_artifact), "--profile", "--num-kv-blocks", "2700", "-tp", "2", "--threads", "1")
    model_lines = [line for line in output.splitlines() if "model under torch.profiler" in line]
    assert len(model_lines) == 3, output
    for line in model_lines:
        assert float(re.search(r"collectives ([\d.]+) ms", line).group(1)) > 0, line
