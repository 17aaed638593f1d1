"""`octavo inspect`: what an artifact holds, read from its manifest."""

from __future__ import annotations

import argparse

from rich.table import Table

from octavo.commands.common import console
from octavo.runtime.loader import read_manifest

_POOL_ROLES = ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("inspect", help="summarize an artifact: model, signature, ops, passes")
    parser.add_argument("artifact", help="artifact directory")
    parser.add_argument("--all-ops", action="store_true", help="list every op, not only the 25 most frequent")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
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
    return 0


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
