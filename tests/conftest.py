"""Shared fixtures: the real tokenizer, tiny random-weight models on disk, compiled artifacts.

Engines in tests run the eager executor (OCTAVO_EXECUTOR=eager, inherited by the `octavo`
subprocesses tests start): the compiled executor AOT-compiles each artifact's graph with
Inductor, ~10 s per tiny artifact and a minute for SmolLM2 on a cold cache, which the many engine
tests on their many artifacts cannot afford. The compiled executor has dedicated tests that ask for
it explicitly (an explicit EngineConfig(executor="compiled") overrides the variable), sharing one
compile per artifact through the session's cache: tests/runtime/test_compiled_executor.py (padding,
warm starts, quantized artifacts), tests/runtime/test_compiled_executor_features.py (speculative
decoding, preemption, prefix caching, n > 1, beams: each against the eager engine's tokens) and the
windowed architecture in tests/test_architectures.py, all on the tiny mistral's one package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from octavo.cache_dir import cache_root

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OCTAVO_EXECUTOR", "eager")
# @triton.jit reads TRITON_INTERPRET when a kernel is defined (at import), and any test may import the
# kernel modules first (compiling an artifact emits kernels): on CPU set it before any test module loads.
if os.environ.get("OCTAVO_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
torch.set_num_threads(2)
# The native CPU kernels take a minute to build: keep them where they are cached between runs, also while
# a test points OCTAVO_CACHE_DIR at a temporary directory (subprocesses inherit this too).
os.environ.setdefault("OCTAVO_CPU_KERNELS_DIR", str(cache_root() / "cpu_kernels"))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes gain nothing from threads, and on a shared 2-core machine two threads can be 50x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def compiled_executor_cache(tmp_path_factory) -> Path:
    """The Octavo cache dir of the session's compiled executors: each artifact compiles once, cold."""
    return tmp_path_factory.mktemp("octavo-cache")


@pytest.fixture
def compiled_cache(monkeypatch, compiled_executor_cache) -> Path:
    """Point OCTAVO_CACHE_DIR at the session's compiled-executor cache for one test."""
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(compiled_executor_cache))
    return compiled_executor_cache


@pytest.fixture(scope="session")
def smollm2_source():
    """The bundled SmolLM2 model source (config + real tokenizer; weights load on demand)."""
    from octavo.frontend import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, smollm2_source) -> Path:
    """The bundled model's real tokenizer saved as HF files, for tiny models to ship with."""
    directory = tmp_path_factory.mktemp("tokenizer")
    smollm2_source.tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir):
    """Factory: a tiny random-weight HF model directory of a given architecture (cached per session)."""
    from tests.tiny_models import make_tiny_model

    made: dict[str, Path] = {}

    def build(model_type: str) -> Path:
        if model_type not in made:
            directory = tmp_path_factory.mktemp(f"tiny-{model_type}")
            model = make_tiny_model(model_type)
            model.save_pretrained(directory)
            for file in tokenizer_dir.iterdir():
                shutil.copy(file, directory / file.name)
            made[model_type] = directory
        return made[model_type]

    return build


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, tiny_model_dir):
    """Factory: a compiled fp32 artifact of a tiny model (cached per session)."""
    from octavo.compiler import compile_model
    from octavo.config import CompileConfig

    made: dict[str, Path] = {}

    def build(model_type: str) -> Path:
        if model_type not in made:
            output = tmp_path_factory.mktemp(f"artifact-{model_type}") / "artifact"
            made[model_type] = compile_model(tiny_model_dir(model_type), output, CompileConfig(dtype="float32"))
        return made[model_type]

    return build


@pytest.fixture(scope="session")
def tiny_mqa_artifact(tmp_path_factory, tokenizer_dir) -> Path:
    """A tiny llama with 6 query heads sharing 1 KV head and a vocabulary of 49153 (divisible by no tp > 1),
    compiled with fuse_qkv and fuse_gate_up off: the shapes and graph forms tensor parallelism must also handle."""
    from octavo.compiler import compile_model
    from octavo.config import CompileConfig
    from tests.tiny_models import make_tiny_model

    directory = tmp_path_factory.mktemp("tiny-mqa")
    make_tiny_model("llama", num_attention_heads=6, num_key_value_heads=1, hidden_size=96, intermediate_size=192,
                    vocab_size=49153).save_pretrained(directory)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, directory / file.name)
    return compile_model(directory, tmp_path_factory.mktemp("artifact-mqa") / "artifact",
                         CompileConfig(dtype="float32", disabled_passes=("fuse_qkv", "fuse_gate_up")))


@pytest.fixture(scope="session")
def tiny_quantized_artifact(tmp_path_factory, tiny_model_dir):
    """Factory: a compiled artifact of a tiny model with quantization options, e.g. ("llama", quant="w4")."""
    from octavo.compiler import compile_model
    from octavo.config import CompileConfig

    made: dict[tuple, Path] = {}

    def build(model_type: str, **options) -> Path:
        key = (model_type, *sorted(options.items()))
        if key not in made:
            name = "-".join(f"{value}" for value in options.values())
            output = tmp_path_factory.mktemp(f"artifact-{model_type}-{name}") / "artifact"
            made[key] = compile_model(tiny_model_dir(model_type), output,
                                      CompileConfig(**{"dtype": "float32", **options}))
        return made[key]

    return build


@dataclass
class CompileRun:
    artifact: Path
    dump_dir: Path
    result: subprocess.CompletedProcess
    seconds: float


@pytest.fixture(scope="session")
def smollm2_fp32_compile(tmp_path_factory) -> CompileRun:
    """`octavo compile smollm2-135m -o A --dump-dir D`, run once as a user would run it."""
    root = tmp_path_factory.mktemp("smollm2-fp32")
    artifact, dump_dir = root / "artifact", root / "dumps"
    start = time.perf_counter()
    result = run_cli("compile", "smollm2-135m", "-o", str(artifact), "--dtype", "float32", "--dump-dir", str(dump_dir))
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    return CompileRun(artifact, dump_dir, result, seconds)


@pytest.fixture(scope="session")
def smollm2_fp32_artifact(smollm2_fp32_compile) -> Path:
    return smollm2_fp32_compile.artifact


@pytest.fixture(scope="session")
def smollm2_bf16_artifact(tmp_path_factory, smollm2_source) -> Path:
    from octavo.compiler import compile_model
    from octavo.config import CompileConfig

    return compile_model(smollm2_source, tmp_path_factory.mktemp("smollm2-bf16") / "artifact",
                         CompileConfig(dtype="bfloat16"))


@pytest.fixture(scope="session")
def smollm2_hf_fp32(smollm2_source):
    """Hugging Face's own SmolLM2 in float32 (eager attention), the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_source.directory, gguf_file=smollm2_source.gguf_file,
                                                 dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_hf_bf16(smollm2_source):
    """Hugging Face's SmolLM2 as a user gets it in bfloat16: from_pretrained(dtype=bfloat16), default attention.

    (Casting the float32 model instead gives other weights: transformers dequantizes GGUF differently per dtype.)
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_source.directory, gguf_file=smollm2_source.gguf_file,
                                                 dtype=torch.bfloat16)
    return model.eval()


def run_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the `octavo` command line in a subprocess (the installed entry point's module)."""
    return subprocess.run([sys.executable, "-m", "octavo.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_pool_full(engine) -> None:
    """No KV block leaked: every block is back in the free list and nothing references it."""
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks, (
        f"{manager.num_blocks - manager.num_free_blocks} KV blocks leaked")
    assert not engine.has_unfinished_requests()
