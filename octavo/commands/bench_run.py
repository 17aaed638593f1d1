"""`octavo bench` run: the workload on the artifact, then the baseline it names.

(The parser is octavo.commands.bench_command.)"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from octavo.bench.runners import run_hf, run_octavo, workload_blocks
from octavo.bench.structured import constrained_params, unconstrained_twins, validity
from octavo.bench.workloads import get_workload, workload_from_file
from octavo.commands.common import console, engine_config, error_console, follow_engine
from octavo.errors import OctavoError
from octavo.parallel import create_engine
from octavo.runtime.engine import LLMEngine
from octavo.runtime.loader import load_artifact


def run_bench(args: argparse.Namespace) -> int:
    workload = workload_from_file(args.prompts_from) if args.prompts_from else get_workload(args.workload)
    if args.num_requests:
        workload = dataclasses.replace(workload, num_requests=args.num_requests,
                                       description=f"{workload.description}, run with --num-requests "
                                                   f"{args.num_requests}")
    if args.server:
        return _run_online(args, workload)
    if args.artifact is None:
        raise OctavoError("give an ARTIFACT directory, or --server URL to benchmark a running server")
    follower_exit = follow_engine(args)
    if follower_exit is not None:
        return follower_exit
    config = engine_config(args)
    if args.vs == "no-speculation" and config.speculative is None:
        raise OctavoError("--vs no-speculation compares against speculative decoding: add --speculative SPEC")
    if args.vs == "unconstrained" and workload.schema_file is None:
        raise OctavoError("--vs unconstrained compares against structured output: use a workload with a schema "
                          "(--workload json_schema)")
    if config.num_threads is None and config.world_size == 1:  # parallel ranks share the cores out themselves
        config.num_threads = 2
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    artifact = load_artifact(args.artifact)
    needed_blocks = workload_blocks(workload, artifact)
    if args.kv_pool_fraction is not None:
        config.num_kv_blocks = max(1, int(needed_blocks * args.kv_pool_fraction))
    engine = create_engine(artifact, config)
    try:
        if args.profile:
            return _run_profile(engine, config, set(getattr(engine.tokenizer, "all_special_ids", [])),
                                workload.schema())
        prompts = workload.prompts(engine.vocab_size, engine.tokenizer)
        params = constrained_params(workload, len(prompts))
        console.print(f"workload {workload.name}: {workload.description} "
                      f"({config.num_threads or torch.get_num_threads()} threads{_layout(config)}, {engine.device}, "
                      f"backend {engine.backend}, "
                      f"KV pool {engine.block_manager.num_blocks} blocks = "
                      f"{engine.block_manager.num_blocks / needed_blocks:.0%} of the {needed_blocks} the workload "
                      "needs)")
        octavo_result, octavo_tokens = run_octavo(engine, workload, prompts, params,
                                                  _lora_mix(engine, args.lora_mix, len(prompts)))
        if params is not None:
            octavo_result.extra["structured"] = validity(workload, octavo_tokens, engine.tokenizer)
    finally:
        engine.shutdown()  # before any baseline engine: a process runs one parallel engine at a time
    console.print(octavo_result.line(), markup=False)
    if args.vs == "unconstrained":
        baseline = create_engine(artifact, config)
        _compare("unconstrained", baseline, workload, prompts, octavo_result, octavo_tokens,
                 unconstrained_twins(octavo_tokens))
    if args.vs in ("no-prefix-caching", "full-pool", "no-speculation"):
        _compare_engine_variant(args.vs, artifact, config, needed_blocks, workload, prompts, octavo_result,
                                octavo_tokens)
    if args.vs_artifact:
        _compare_artifact(args.vs_artifact, config, workload, prompts, octavo_result, octavo_tokens)
    if args.vs == "hf":
        hf_result, hf_tokens = _run_hf_baseline(engine, workload, prompts)
        same = sum(a == b for a, b in zip(octavo_tokens, hf_tokens, strict=True))
        console.print(hf_result.line(), markup=False)
        ratio = octavo_result.output_tokens_per_s / hf_result.output_tokens_per_s
        console.print(f" ratio {workload.name}: octavo/hf output tok/s = {ratio:.2f}x; "
                      f"identical greedy outputs {same}/{len(prompts)}", markup=False)
    return 0


def _lora_mix(engine: LLMEngine, count: int, num_requests: int) -> list[str | None] | None:
    """The adapter of each request: the first `count` loaded adapters in turn (None without --lora-mix)."""
    if not count:
        return None
    loaded = sorted(engine.lora.slots, key=engine.lora.slots.get) if engine.lora is not None else []
    if len(loaded) < count:
        raise OctavoError(f"--lora-mix {count} needs {count} loaded LoRA adapters; the engine has {len(loaded)} "
                          "(octavo compile --lora, or --lora-modules)")
    console.print(f"requests under the LoRA adapters {', '.join(loaded[:count])} in turn")
    return [loaded[index % count] for index in range(num_requests)]


def _compare_engine_variant(variant: str, artifact, config, needed_blocks: int, workload, prompts,
                            result, tokens) -> None:
    """Run the same workload on a second engine that differs in one option, and print the ratio."""
    changes = {"no-prefix-caching": {"enable_prefix_caching": False},
               "full-pool": {"num_kv_blocks": needed_blocks, "kv_cache_memory": None},
               "no-speculation": {"speculative": None}}[variant]
    baseline = create_engine(artifact, dataclasses.replace(config, **changes))
    _compare(variant, baseline, workload, prompts, result, tokens)


def _compare_artifact(path: str, config, workload, prompts, result, tokens) -> None:
    """Run the same workload on a second artifact with the same engine options, and print the ratio."""
    _compare(f"octavo[{path}]", create_engine(load_artifact(path), config), workload, prompts, result, tokens)


def _compare(name: str, baseline: LLMEngine, workload, prompts, result, tokens, params=None) -> None:
    try:
        baseline_result, baseline_tokens = run_octavo(baseline, workload, prompts, params)
    finally:
        baseline.shutdown()
    baseline_result.engine = name
    console.print(baseline_result.line(), markup=False)
    same = sum(a == b for a, b in zip(tokens, baseline_tokens, strict=True))
    ratio = result.output_tokens_per_s / baseline_result.output_tokens_per_s
    decode = ""
    if result.itl_s and baseline_result.itl_s:
        # Per-request decode speed: speculation changes it, prefill (in output tok/s too) it does not.
        decode = (f"; per-request decode speed (1/ITL mean) = "
                  f"{statistics.mean(baseline_result.itl_s) / statistics.mean(result.itl_s):.2f}x")
    console.print(f" ratio {workload.name}: octavo/{name} output tok/s = {ratio:.2f}x{decode}; "
                  f"identical greedy outputs {same}/{len(prompts)}", markup=False)


def _run_profile(engine: LLMEngine, config, special: set[int], schema: dict | None) -> int:
    from octavo.bench.profile import format_profiles, profile_engine
    from octavo.runtime.structured import StructuredOutputs

    console.print(f"profile of {engine.artifact.path} ({config.num_threads} threads, {engine.device}, "
                  f"backend {engine.backend}, executor {engine.executor_kind}); phases are medians of "
                  "unprofiled steps, the model split comes from one step under torch.profiler")
    vocab_ids = [token for token in range(engine.vocab_size) if token not in special]
    structured = StructuredOutputs(json=schema) if schema is not None else None
    for line in format_profiles(profile_engine(engine, vocab_ids, structured=structured)):
        console.print(line, markup=False)
    return 0


def _run_online(args: argparse.Namespace, workload) -> int:
    import asyncio

    from octavo.bench.online import online_prompts, run_online, served_model

    card = served_model(args.server, args.api_key)
    prompts = online_prompts(workload, card, args.artifact)
    model = args.model or card["id"]
    console.print(f"workload {workload.name}: {workload.description}; online against {args.server} ({model}), "
                  f"Poisson arrivals at {args.rate:g} req/s")
    result = asyncio.run(run_online(args.server, model, prompts, workload.output_len, args.rate, workload.name,
                                    args.api_key))
    console.print(result.line(), markup=False)
    return 0


def _run_hf_baseline(engine: LLMEngine, workload, prompts):
    from octavo.frontend.sources import load_model

    manifest = engine.artifact.manifest
    source = manifest["source"]
    origin = source["name"] if source["kind"] == "bundled" else source["path"]
    error_console.print(f"loading Hugging Face model {origin} ({manifest['dtype']}) for the baseline")
    model = load_model(origin).load_module(manifest["dtype"])
    pad = engine.eos_token_ids[0] if engine.eos_token_ids else None
    return run_hf(model, workload, prompts, pad)


def _layout(config) -> str:
    """ per rank, tensor parallel N x pipeline parallel P" for a parallel engine, else nothing."""
    if config.world_size == 1:
        return ""
    return (f" per rank, tensor parallel {config.tensor_parallel_size} x pipeline parallel "
            f"{config.pipeline_parallel_size}")
