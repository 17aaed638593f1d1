"""compile_model: model source -> traced graph -> passes -> artifact on disk."""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from octavo.codegen.artifact import check_output_dir, write_artifact
from octavo.codegen.cpu_backend.precision import resolve_precision
from octavo.codegen.triton_backend.sources import kernel_sources, source_hashes, write_kernel_sources
from octavo.config import CompileConfig
from octavo.errors import OctavoError
from octavo.eval.corpus import text_digest
from octavo.eval.sources import calibration_text
from octavo.frontend import load_model, trace
from octavo.frontend.calibration import collect_linear_inputs
from octavo.frontend.features import architecture_features
from octavo.frontend.sources import ModelSource
from octavo.frontend.trace import TracedModel, trace_module
from octavo.ir.graph import format_value, op_histogram
from octavo.ir.layer_summary import layer_summary
from octavo.passes import PassContext, run_pipeline
from octavo.passes.quant_schemes import Calibration, scheme_for
from octavo.version import __version__

logger = logging.getLogger(__name__)

DUMP_DIR_ENV = "OCTAVO_DUMP_DIR"


def compile_model(source: str | os.PathLike | ModelSource, output_dir: str | os.PathLike | None,
                  config: CompileConfig | None = None, *, overwrite: bool = False,
                  on_print_ir: Callable[[str, str], None] | None = None,
                  on_stage: Callable[[str], None] | None = None) -> Path | None:
    """Compile `source` (bundled name, HF directory, .gguf file) into an artifact at `output_dir`.

    Returns the artifact path, or None when `config.stop_after` stopped the
    pipeline early (then only dumps / printed IR are produced). The dump
    directory comes from `config.dump_dir` or the OCTAVO_DUMP_DIR variable.
    dtype "auto" is resolved for this machine first (see cpu_backend.precision).
    """
    config = _checked_config(config, output_dir, overwrite)
    stage = on_stage or (lambda message: logger.info(message))
    timings: dict[str, float] = {}
    with _timed(timings, "load_source"):
        model_source = source if isinstance(source, ModelSource) else load_model(source)
    weights = "" if config.storage_dtype == config.dtype else f", {config.storage_dtype} weights"
    stage(f"tracing {model_source.name} ({model_source.config.model_type}, {config.dtype}{weights})")
    with _timed(timings, "load_weights"):
        module = model_source.load_module(config.dtype)
    with _timed(timings, "trace"):
        traced = trace_module(module)
    return _compile_traced(model_source, traced, output_dir, config, timings, overwrite, on_print_ir, stage)


def compile_variants(source: str | os.PathLike | ModelSource,
                     variants: list[tuple[str | os.PathLike, CompileConfig]], *, overwrite: bool = False,
                     on_stage: Callable[[str], None] | None = None) -> list[Path]:
    """Compile several artifacts of one model (e.g. fp32, w8, w4), tracing it once per dtype.

    Each artifact is exactly what compile_model writes for its config: the passes run on a
    fresh copy of the traced graph, so only the trace (which depends on the model and the
    dtype alone) is shared.
    """
    stage = on_stage or (lambda message: logger.info(message))
    start = time.perf_counter()
    model_source = source if isinstance(source, ModelSource) else load_model(source)
    load_seconds = time.perf_counter() - start
    traces: dict[str, TracedModel] = {}
    calibrations: dict = {}
    paths = []
    for output_dir, config in variants:
        config = _checked_config(config, output_dir, overwrite)
        timings = {"load_source_s": load_seconds}
        start = time.perf_counter()
        if config.dtype not in traces:
            stage(f"tracing {model_source.name} ({model_source.config.model_type}, {config.dtype})")
            traces[config.dtype] = trace(model_source, config.dtype)
        traced = traces[config.dtype].copy()
        timings["trace_s"] = time.perf_counter() - start
        paths.append(_compile_traced(model_source, traced, output_dir, config, timings, overwrite, None, stage,
                                     calibrations))
    return paths


@contextlib.contextmanager
def _timed(timings: dict[str, float], stage: str) -> Iterator[None]:
    """Record the wall (`<stage>_s`) and CPU (`<stage>_cpu_s`, all threads) seconds of the block."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    timings[f"{stage}_s"] = time.perf_counter() - wall
    timings[f"{stage}_cpu_s"] = time.process_time() - cpu


def _checked_config(config: CompileConfig | None, output_dir, overwrite: bool) -> CompileConfig:
    config = resolve_precision(config or CompileConfig())
    scheme_for(config)  # an unknown or not yet available scheme fails before any work
    resolve_lora(config)
    if config.dump_dir is None and os.environ.get(DUMP_DIR_ENV):
        config.dump_dir = os.environ[DUMP_DIR_ENV]
    if output_dir is None and config.stop_after is None:
        raise OctavoError("an output directory is required (-o DIR)")
    if output_dir is not None:
        check_output_dir(output_dir, overwrite)
    return config


def _compile_traced(model_source: ModelSource, traced: TracedModel, output_dir, config: CompileConfig,
                    timings: dict[str, float], overwrite: bool, on_print_ir, stage,
                    calibrations: dict | None = None) -> Path | None:
    """Passes on a traced graph, then the artifact (see compile_model).

    `calibrations` (compile_variants) keeps calibration statistics by dtype and text, so
    several calibrated variants of one model run the float model on the text once.
    """
    start = time.perf_counter()
    calibration = _calibration(model_source, traced, config, stage, calibrations)
    if calibration is not None:
        timings["calibration_s"] = time.perf_counter() - start
    ctx = PassContext(config=config, weights=traced.weights, model_config=model_source.config,
                      architecture=model_source.architecture, fake_mode=traced.fake_mode,
                      symbols={"T": traced.num_tokens},
                      provided_weights=_provided_weights(model_source, traced, config),
                      calibration=calibration)
    stage("running passes")
    with _timed(timings, "passes"):
        graph_module = run_pipeline(traced.graph_module, ctx, on_print_ir=on_print_ir)
    timings.update({f"shape_propagation_{key}": value for key, value in ctx.propagation_timings.items()})
    if config.stop_after is not None or output_dir is None:
        logger.info("stopped after pass %s: no artifact written", config.stop_after)
        return None
    stage(f"writing artifact {output_dir}")
    start = time.perf_counter()
    manifest = build_manifest(model_source, config, ctx, graph_module, timings)
    kernels = kernel_sources(graph_module)
    manifest["kernels"] = source_hashes(kernels)
    if config.dump_dir:
        write_kernel_sources(Path(config.dump_dir) / "kernels", kernels)
    path = write_artifact(output_dir, graph_module=graph_module, input_specs=input_specs(graph_module, ctx),
                          weights=ctx.weights, manifest=manifest, tokenizer=model_source.tokenizer,
                          generation_config=model_source.generation_config(), kernels=kernels,
                          overwrite=overwrite)
    logger.info("artifact written in %.1fs", time.perf_counter() - start)
    return path


def _calibration(model_source: ModelSource, traced: TracedModel, config: CompileConfig,
                 stage: Callable[[str], None], calibrations: dict | None = None) -> Calibration | None:
    """When the scheme calibrates: the calibration text's token ids (--calibration FILE, else the built-in
    text) and the statistics of every linear's input over runs of it through the traced float graph."""
    scheme = scheme_for(config)
    if scheme is None or not scheme.calibrated:
        if config.calibration is not None:
            logger.warning("--calibration is ignored: --quant %s does not calibrate", config.quant)
        return None
    source = config.calibration or "default"
    text = calibration_text(source)
    token_ids = list(model_source.tokenizer.encode(text, add_special_tokens=False))
    key = (config.dtype, source, text_digest(text), scheme.sequential_key())
    if calibrations is not None and key in calibrations:
        return calibrations[key]
    calibration = Calibration(source, text_digest(text), token_ids)
    runs = calibration.calibration_runs()
    stage(f"calibrating on {sum(map(len, runs))} tokens of the {source} text ({len(runs)} runs)")
    replace = None
    if scheme.sequential_key() is not None:
        def replace(name, weight, stats):
            return scheme.replace_calibrated_weight(name, weight, stats, calibration)
    calibration.linear_inputs = collect_linear_inputs(traced.graph_module, traced.weights, runs, config.progress,
                                                      replace)
    calibration.runs, calibration.run_tokens = len(runs), sum(map(len, runs))
    if calibrations is not None:
        calibrations[key] = calibration
    return calibration


def _provided_weights(model_source: ModelSource, traced, config: CompileConfig) -> dict:
    """The source's already quantized weights (GGUF Q8_0/Q4_0/Q4_1) by placeholder name, when quantizing."""
    if config.quant == "none":
        return {}
    by_hf_name = model_source.quantized_weights()
    return {name: by_hf_name[source] for name, source in traced.weight_sources.items() if source in by_hf_name}


def input_specs(graph_module, ctx: PassContext) -> dict[str, tuple[torch.dtype, list]]:
    """dtype and shape (ints, or symbol names like "T") of every graph input."""
    names = ctx.symbol_names()
    specs = {}
    for node in graph_module.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta["val"]
        dims = [int(dim) if isinstance(dim, int) or str(dim).isdigit() else _symbolic(dim, names)
                for dim in value.shape]
        specs[node.name] = (value.dtype, dims)
    return specs


def resolve_lora(config: CompileConfig) -> None:
    """Targets and rank from the --lora adapters (their union and their largest rank) where not given; an
    adapter above a given max_lora_rank, or targeting modules outside given lora_targets, is refused."""
    from octavo.ir.lora_format import LoraAdapterError, read_adapter_config

    targets, rank = set(config.lora_targets), config.max_lora_rank
    for entry in config.lora_adapters:
        name, _, path = entry.partition("=")
        adapter = read_adapter_config(path)
        modules = adapter.get("target_modules") or []
        modules = {modules} if isinstance(modules, str) else set(modules)
        if config.max_lora_rank and adapter["r"] > config.max_lora_rank:
            raise LoraAdapterError(f"LoRA adapter {name!r} has rank {adapter['r']}, above --max-lora-rank "
                                   f"{config.max_lora_rank}")
        if config.lora_targets and not modules <= set(config.lora_targets):
            raise LoraAdapterError(f"LoRA adapter {name!r} targets {', '.join(sorted(modules - targets))}, "
                                   f"outside --lora-targets {', '.join(config.lora_targets)}")
        targets |= modules
        rank = max(rank, adapter["r"]) if not config.max_lora_rank else rank
    config.lora_targets, config.max_lora_rank = tuple(sorted(targets)), rank
    if config.lora_targets and config.max_lora_rank < 1:
        raise OctavoError("LoRA targets need a rank: give --max-lora-rank or a --lora adapter")


def _lora_manifest(config: CompileConfig, ctx: PassContext) -> dict | None:
    """insert_lora's layout, with the adapters to load at start (name -> absolute path)."""
    if ctx.lora is None:
        return None
    adapters = {entry.partition("=")[0]: str(Path(entry.partition("=")[2]).resolve())
                for entry in config.lora_adapters}
    return {**ctx.lora, "adapters": adapters}


def _symbolic(dim, names: dict[str, str]) -> str:
    text = format_value(dim, names)
    return text.removeprefix("sym ")


def build_manifest(model_source: ModelSource, config: CompileConfig, ctx: PassContext, graph_module,
                   timings: dict[str, float]) -> dict:
    """Everything that decides or describes the artifact's output (docs/architecture.md, "The artifact")."""
    model_config = model_source.config
    generation = model_source.generation_config()
    output = graph_module.graph.output_node().args[0]
    specs = input_specs(graph_module, ctx)
    runtime_inputs = {name: {"dtype": str(dtype).removeprefix("torch."), "shape": shape,
                             "role": ctx.runtime_inputs.get(name, {}).get("role", "tokens")}
                      for name, (dtype, shape) in specs.items() if name not in ctx.weights}
    return {
        "octavo_version": __version__,
        "versions": {"torch": torch.__version__, "transformers": _transformers_version(),
                     "python": platform.python_version()},
        "created_unix": int(time.time()),
        "source": {"name": model_source.name, "kind": model_source.kind, "model_type": model_config.model_type,
                   "checksum_sha256": model_source.checksum, "path": str(model_source.path),
                   "config": model_config.to_dict()},
        "architecture_features": _features_with_counts(model_config, graph_module),
        "compile_options": config.output_key(),
        "dtype": config.dtype,
        "weight_dtype": config.storage_dtype,
        "dtype_choice": config.dtype_choice or "requested",
        "quantization": ctx.quantization,
        "lora": _lora_manifest(config, ctx),
        "vocab_size": int(model_config.vocab_size),
        "max_model_len": int(getattr(model_config, "max_position_embeddings", 2048)),
        "eos_token_ids": _eos_token_ids(generation, model_source.tokenizer),
        "kv_layout": ctx.kv_layout,
        "signature": {
            "inputs": runtime_inputs,
            "outputs": {"logits": {"dtype": str(output.meta["val"].dtype).removeprefix("torch."),
                                   "shape": ["N", int(output.meta["val"].shape[-1])]}},
            "num_weights": len(ctx.weights),
            "weight_bytes": sum(t.numel() * t.element_size() for t in ctx.weights.values()),
        },
        "passes": ctx.history,
        "op_histogram": op_histogram(graph_module),
        "node_count": len(graph_module.graph.nodes),
        "layers": layer_summary(graph_module),
        "compile_timings": {key: round(value, 3) for key, value in timings.items()},
    }


def _features_with_counts(model_config, graph_module) -> list[dict]:
    """architecture_features of the model, each with how many nodes of the octavo ops it names the graph has."""
    histogram = op_histogram(graph_module)
    features = []
    for feature in architecture_features(model_config):
        ops = {name for name in histogram if name.startswith("octavo.") and name in feature.ops.split("(")[0]}
        features.append({**feature.as_dict(), "nodes": sum(histogram[name] for name in ops)})
    return features


def _eos_token_ids(generation_config, tokenizer) -> list[int]:
    ids = generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
