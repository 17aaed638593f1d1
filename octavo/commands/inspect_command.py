"""`octavo inspect`: what an artifact holds, read from its manifest; with --memory, what it takes once loaded.

The manifest says how the weights are stored. What a loaded engine holds can differ: a kernel may keep
a converted copy (the torch backend widens fp8, and w8 / w4 where ATen's packed matmuls do not apply, to
bfloat16 or float32 at load; the compiled executor's library holds its own prepacked copy of the
float weights). `--memory` loads the engine on this machine, as `generate` would with the same
--backend and --executor, runs one short request (so that every memory-mapped weight has been read
once, as in serving), and reports the process's resident memory before and after (Linux's VmRSS: the
memory-mapped weights count once read) and the bytes of the weights the graph's kernels hold, by
dtype. A compiled executor that had to compile first leaves the compiler's memory in the process:
the report says so, and a second run (a warm start) measures what serving holds.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from rich.table import Table

from octavo.commands.common import console

_POOL_ROLES = ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("inspect", help="summarize an artifact: model, signature, ops, passes")
    parser.add_argument("artifact", help="artifact directory")
    parser.add_argument("--all-ops", action="store_true", help="list every op, not only the 25 most frequent")
    parser.add_argument("--memory", action="store_true",
                        help="load the engine here and report its resident memory and the weights its kernels hold")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton", "cpu"],
                        help="with --memory: the backend to load with (default: auto)")
    parser.add_argument("--executor", default="auto", choices=["auto", "compiled", "eager"],
                        help="with --memory: the executor to load with (default: auto)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from octavo.runtime.loader import read_manifest  # here: the parser of every command imports this module

    manifest = read_manifest(args.artifact)
    source = manifest["source"]
    layout = manifest["kv_layout"]
    console.print(f"[bold]{args.artifact}[/bold]: Octavo artifact, format {manifest['format_version']}, "
                  f"octavo {manifest['octavo_version']}")
    console.print(f"model    {source['name']} ({source['model_type']}, {source['kind']}), "
                  f"sha256 {source['checksum_sha256'][:16]}")
    scheme = (manifest.get("quantization") or {}).get("scheme", "none")
    console.print(f"dtype    {manifest['dtype']}, weights {manifest.get('weight_dtype', manifest['dtype'])}, "
                  f"quantization {scheme}, "
                  f"vocab {manifest['vocab_size']}, max_model_len {manifest['max_model_len']}")
    if manifest.get("dtype_choice", "requested") != "requested":
        console.print(f"         ({manifest['dtype_choice']})", markup=False)
    console.print(f"kv cache {layout['num_layers']} layers x {layout['num_kv_heads']} kv heads x "
                  f"{layout['head_dim']} dims, block {layout['block_size']}, {layout['cache_dtype']}")
    _print_quantization(manifest.get("quantization"))
    signature = manifest["signature"]
    inputs = ", ".join(f"{name}: {spec['dtype']}[{', '.join(map(str, spec['shape']))}]"
                       for name, spec in signature["inputs"].items()
                       if spec["role"] not in _POOL_ROLES)
    pools = sum(spec["role"] in _POOL_ROLES for spec in signature["inputs"].values())
    console.print(f"inputs   {inputs} + {pools} cache pools")
    console.print(f"weights  {signature['num_weights']} tensors, {signature['weight_bytes'] / 2**20:.1f} MiB")
    console.print(f"graph    {manifest['node_count']} nodes")
    _print_features(manifest.get("architecture_features") or [])
    console.print(_ops_table(manifest["op_histogram"], args.all_ops))
    if manifest.get("layers"):
        _print_layers(manifest["layers"])
    console.print(_passes_table(manifest["passes"]))
    if args.memory:
        _print_memory(measure_loaded_memory(Path(args.artifact), args.backend, args.executor))
    return 0


MEMORY_KV_BLOCKS = 16
"""KV blocks of the engine --memory loads: the cache is sized at serving time, so as little as runs."""


def resident_bytes() -> int | None:
    """The process's resident memory (VmRSS), None where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measure_loaded_memory(artifact: Path, backend: str, executor: str) -> dict:
    """Load an engine of `artifact` (MEMORY_KV_BLOCKS blocks) and measure it; see the module docstring."""
    from octavo.config import EngineConfig
    from octavo.runtime.engine import LLMEngine
    from octavo.runtime.sampling_params import SamplingParams

    before = resident_bytes()
    engine = LLMEngine(artifact, EngineConfig(num_kv_blocks=MEMORY_KV_BLOCKS, backend=backend, executor=executor))
    engine.add_request(list(range(3, 11)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    after = resident_bytes()
    held: Counter = Counter()
    seen: set[int] = set()
    for tensor in [*engine.executor.graph_module.buffers(), *engine.executor.graph_module.parameters()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held[str(tensor.dtype).removeprefix("torch.")] += storage.nbytes()
    kv_bytes = sum(tensor.nbytes for tensor in engine.kv_cache.tensors.values())
    compiled_now = getattr(engine.executor, "compile_seconds", 0.0) > 0
    return {"backend": engine.backend, "executor": engine.executor_kind, "weights": dict(held.most_common()),
            "kv_bytes": kv_bytes, "resident_before": before, "resident_after": after, "compiled_now": compiled_now}


def _print_memory(report: dict) -> None:
    mib = 2**20
    weights = ", ".join(f"{dtype} {size / mib:.1f}" for dtype, size in report["weights"].items())
    console.print(f"memory   loaded here ({report['backend']} backend, {report['executor']} executor): weights held "
                  f"by the kernels {sum(report['weights'].values()) / mib:.1f} MiB ({weights})", markup=False)
    if report["resident_before"] is not None and report["resident_after"] is not None:
        grown = report["resident_after"] - report["resident_before"]
        console.print(f"         resident memory {report['resident_after'] / mib:.1f} MiB, {grown / mib:.1f} MiB of it "
                      f"from loading and one request (KV cache of {MEMORY_KV_BLOCKS} blocks: "
                      f"{report['kv_bytes'] / mib:.1f} MiB)", markup=False)
    if report["compiled_now"]:
        console.print("         (the graph was compiled just now, whose memory this includes: run again for a warm "
                      "start's figure)", markup=False)


def _print_features(features: list[dict]) -> None:
    """The architecture's features (beyond a plain Llama) and the ops they became, with their node counts."""
    for index, feature in enumerate(features):
        nodes = f" ({feature['nodes']} nodes)" if feature.get("nodes") else ""
        console.print(f"{'features' if index == 0 else '':<8} {feature['name']}: {feature['detail']} -> "
                      f"{feature['ops']}{nodes}", markup=False)


def _calibration_text(calibration: dict | None) -> str:
    """'none', or the text's name, the tokens the float model ran on and the text's digest."""
    if not calibration:
        return "none"
    used = calibration.get("tokens_used", calibration["tokens"])
    return (f"{calibration['source']} text ({used} of its {calibration['tokens']} tokens, "
            f"sha256 {calibration['sha256'][:12]})")


def _print_quantization(record: dict | None) -> None:
    """Scheme, group size, where the values came from, what stayed float and why, KV cache storage."""
    if not record:
        return
    if record.get("scheme", "none") != "none":
        group = record["group_size"] or "per channel"
        values = ", ".join(f"{count} {origin}" for origin, count in record["values"].items())
        calibration = _calibration_text(record.get("calibration"))
        console.print(f"quant    {record['scheme']}: {record['layout']} weights, group {group}, "
                      f"values {values}; calibration {calibration}", markup=False)
        activations = record.get("activations")
        if activations:
            console.print(f"         activations rounded to {activations['dtype']} at run time "
                          f"({activations['granularity']}), except {activations['except']}", markup=False)
        for entry in (record.get("vocab") or {}).get("weights", []):
            tied = ", tied embedding/lm_head" if entry["tied"] else ""
            console.print(f"         {entry['weight']}: {entry['layout']} group {entry['group_size']} "
                          f"({entry['origin']}{tied})", markup=False)
        for entry in record["left_unquantized"]:
            weights = entry["weights"] if isinstance(entry["weights"], str) else ", ".join(entry["weights"])
            console.print(f"         float: {weights}: {entry['reason']}", markup=False)
        console.print(f"         weights {record['weight_bytes_before'] / 2**20:.1f} MiB -> "
                      f"{record['weight_bytes_after'] / 2**20:.1f} MiB", markup=False)
    kv = record.get("kv_cache")
    if kv:
        console.print(f"kv quant {kv['dtype']} cache, {kv['scales']}", markup=False)


def _ops_table(histogram: dict[str, int], show_all: bool) -> Table:
    table = Table(title="op histogram", title_justify="left")
    table.add_column("op")
    table.add_column("count", justify="right")
    items = list(histogram.items())
    for name, count in items if show_all else items[:25]:
        table.add_row(name, str(count))
    if not show_all and len(items) > 25:
        table.add_row(f"... {len(items) - 25} more (--all-ops)", "")
    return table


def _print_layers(layers: list[dict]) -> None:
    """The ops each layer runs, in order (layout-only ops left out); equal layers share a line.

    Plain lines rather than a table: a layer's op list is long, and one line per group keeps it
    greppable whatever the terminal width.
    """
    console.print("per layer (ops in order, weight role in parentheses)")
    width = max(len(group["name"]) for group in layers)
    for group in layers:
        console.print(f"  {group['name']:<{width}}  {', '.join(group['ops'])}", markup=False)


def _passes_table(passes: list[dict]) -> Table:
    table = Table(title="passes", title_justify="left")
    for column in ("#", "pass", "nodes", "time", "stats"):
        table.add_column(column)
    for record in passes:
        stats = ", ".join(f"{key}={value}" for key, value in record["stats"].items())
        table.add_row(str(record.get("index", "")), record["name"],
                      f"{record['nodes_before']} -> {record['nodes_after']}", f"{record['time_s']:.2f}s", stats)
    return table
