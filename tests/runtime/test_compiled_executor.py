"""The compiled executor (AOTInductor): padded decode buckets, warm start, fallback, quantized artifacts.

The tiny windowed architecture (mistral: sliding-window attention cuts the longer contexts) is the
one whose logits tests/test_architectures.py checks against HF through the compiled executor; the
tests here use its artifact too, so both share one compiled package through the session's cache
(one Inductor compile per artifact and backend, ~10 s each).
"""

from __future__ import annotations

import logging

import pytest
import torch

from octavo.cli import main
from octavo.errors import OctavoError
from octavo.runtime.input_batch import build_step_inputs
from octavo.runtime.loader import load_artifact
from octavo.runtime.scheduler import ScheduledSequence
from octavo.runtime.step_buffers import batch_size_ladder
from tests.runtime.engine_helpers import greedy, make_engine, run_to_completion

MAX_SEQS = 12  # ladder 1, 2, 4, 8, 12: sizes 3, 5-7 and 9-11 pad
# Padding changes only the GEMMs' row count M, and oneDNN blocks an fp32 GEMM by M: a real row's
# dot products are summed in another order, a few ulps (1.2e-7 relative) apart per GEMM. Logits of
# magnitude < 10 after two layers stay within 1e-5; a wrong row, context or slot moves them by > 0.1.
PADDING_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    """The tiny mistral artifact, loaded once (it replaces the engine tests' llama here)."""
    return load_artifact(tiny_artifact("mistral"))


@pytest.fixture(scope="module")
def decoding_engine(artifact, compiled_executor_cache):
    """A compiled-executor engine with MAX_SEQS sequences of different lengths, all past their prefill."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OCTAVO_CACHE_DIR", str(compiled_executor_cache))
        engine = make_engine(artifact, max_num_seqs=MAX_SEQS, num_kv_blocks=128, executor="compiled")
    generator = torch.Generator().manual_seed(0)
    for index in range(MAX_SEQS):
        engine.add_request(torch.randint(3, 49000, (7 + 9 * index,), generator=generator).tolist(), greedy(8))
    while engine.scheduler.waiting or any(seq.num_output_tokens == 0 for seq in engine.scheduler.running):
        engine.step()
    return engine


def test_ladder():
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(8) == [1, 2, 4, 8]
    assert batch_size_ladder(12) == [1, 2, 4, 8, 12]
    assert batch_size_ladder(40) == [1, 2, 4, 8, 16, 24, 32, 40]


@pytest.mark.parametrize("num_seqs", range(1, MAX_SEQS + 1))
def test_padded_decode_step_equals_unpadded(decoding_engine, num_seqs):
    """The same decode step on the ladder's padded buffers and on its own n-row inputs."""
    engine = decoding_engine
    sequences = engine.scheduler.running[:num_seqs]
    for seq in sequences:  # room for the step's token; K/V written twice to one slot is written once
        engine.block_manager.allocate(seq, seq.num_computed_tokens + 1)
    inputs = build_step_inputs([ScheduledSequence(seq, 1) for seq in sequences], engine.block_manager.block_size)
    feed = engine.runner.prepare(inputs)
    padded = engine.runner.execute(feed)
    unpadded = engine.executor.run({**inputs.as_dict(), **engine.kv_cache.tensors})
    size = next(size for size in batch_size_ladder(MAX_SEQS) if size >= num_seqs)
    assert feed.size == size and feed.tensors["input_ids"].shape == (size,)
    assert padded.shape == unpadded.shape == (num_seqs, engine.vocab_size)
    assert (padded - unpadded).abs().max().item() <= PADDING_TOLERANCE
    assert torch.equal(padded.argmax(-1), unpadded.argmax(-1))


def test_compiled_outputs_equal_eager_and_a_second_engine_starts_warm(artifact, compiled_cache):
    prompts = [[5, 17, 3000, 42, 9], list(range(100, 160)), [7] * 20]
    outputs = {}
    for name, executor in (("eager", "eager"), ("compiled", "compiled"), ("second", "compiled")):
        engine = make_engine(artifact, executor=executor, max_num_seqs=4)
        for prompt in prompts:
            engine.add_request(prompt, greedy(12))
        outputs[name] = [output.outputs[0].token_ids for output in run_to_completion(engine).values()]
        if name == "second":
            assert engine.executor.compile_seconds == 0.0, "the second engine compiled again"
            assert engine.executor.path.parent == compiled_cache / "executor"
    assert outputs["compiled"] == outputs["eager"] == outputs["second"]


def test_the_package_is_frozen_with_linears_on_prepacked_onednn_weights(artifact, compiled_cache):
    """Freezing happened: the linears call oneDNN on prepacked weights, not a GEMM on the artifact's tensors.

    (Inductor freezes only when autograd is off while it compiles; unfrozen, prefill GEMMs run ~2x slower.)
    """
    executor = make_engine(artifact, executor="compiled").executor
    library = (executor.path / "model.so").read_bytes()
    assert b"_linear_pointwise" in library
    assert b"aoti_torch_cpu_mm_out" not in library


def test_warmup_command_loads_the_cached_graph(artifact, compiled_cache, capsys, monkeypatch):
    """`octavo warmup` finds the package the tests compiled and loads it (a warm start)."""
    make_engine(artifact, executor="compiled")  # compiled here, or already in the session cache
    monkeypatch.setenv("OCTAVO_EXECUTOR", "auto")
    assert main(["warmup", str(artifact.path), "--threads", str(torch.get_num_threads()), "--executor", "auto"]) == 0
    printed = capsys.readouterr().out
    assert "loaded the compiled graph" in printed and "(warm)" in printed, printed


def test_without_a_compiler_auto_falls_back_to_eager_and_compiled_fails_clearly(artifact, tmp_path, monkeypatch,
                                                                               caplog):
    """No C++ compiler on PATH and nothing cached: auto warns once and runs eagerly; compiled fails, saying why."""
    empty = tmp_path / "bin"
    empty.mkdir()
    for name, value in (("OCTAVO_CACHE_DIR", tmp_path / "cache"), ("PATH", empty), ("CXX", "no-such-compiler"),
                        ("OCTAVO_EXECUTOR", "auto")):
        monkeypatch.setenv(name, str(value))
    with caplog.at_level(logging.WARNING, logger="octavo.runtime.executor_choice"):
        engines = [make_engine(artifact, executor="auto") for _ in range(2)]
    assert [engine.executor_kind for engine in engines] == ["eager", "eager"]
    warnings = [record.getMessage() for record in caplog.records if "running the graph eagerly" in record.getMessage()]
    assert len(warnings) == 1 and all("no C++ compiler found (no-such-compiler" in text for text in warnings)
    with pytest.raises(OctavoError, match="compiled executor is unavailable: no C\\+\\+ compiler found"):
        make_engine(artifact, executor="compiled")
    assert not (tmp_path / "cache" / "executor").exists()


# One artifact per backend: w8 linears with a 4-bit vocabulary on the torch backend (its paged
# attention), w4 linears with an int8 vocabulary and an int8 KV cache (scale caches written in
# place) on the cpu backend. Their linears are opaque ops the compiled library calls back; Inductor
# compiles the ops around them and the embedding gathers, which eager runs as separate torch ops:
# same greedy tokens.
QUANTIZED = [("torch", {"quant": "w8", "vocab_quant": "w4"}),
             ("cpu", {"quant": "w4", "vocab_quant": "int8", "kv_cache_dtype": "int8"})]


@pytest.mark.parametrize(("backend", "options"), QUANTIZED, ids=["w8-torch", "w4-int8kv-cpu"])
def test_quantized_artifact_compiled_equals_eager(tiny_quantized_artifact, compiled_cache, backend, options):
    quantized = tiny_quantized_artifact("llama", **options)
    prompts = [[5, 17, 3000, 42, 9], list(range(100, 160)), [7] * 20]
    outputs = {}
    for executor in ("eager", "compiled"):
        engine = make_engine(quantized, executor=executor, backend=backend, max_num_seqs=4)
        assert engine.executor_kind == executor and engine.backend == backend
        for prompt in prompts:
            engine.add_request(prompt, greedy(10))
        outputs[executor] = [output.outputs[0].token_ids for output in run_to_completion(engine).values()]
    assert outputs["compiled"] == outputs["eager"]
