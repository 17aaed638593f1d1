"""Compare quantization variants of one model: perplexity on the same tokens and weights on disk.

    python scripts/quant_compare.py --out /tmp/quant [--model smollm2-135m] [--max-text-tokens 8192] \
        [--variants fp32,bf16,w8,w4,fp8,kv-int8,kv-fp8] [--texts default,code,reference,prose] [--threads 2]

Compiles each variant (one trace per dtype, see octavo.compiler.compile_variants) into
OUT/<variant>, scores each text (a built-in name of `octavo eval --perplexity`, or a file;
default: the built-in evaluation text) with `octavo eval`'s window 512 / stride 256, and
prints a markdown table per text: perplexity, its change against the first variant, weights
on disk (weights.safetensors, embedding included) and their ratio to bf16 when a bf16
variant is in the list; with several texts, then each variant's change against the first
on every text. Writes OUT/results.json too.

A variant is `dtype[:option=value...]` or one of the names in VARIANTS, e.g.
`fp32:quant=w4:group_size=128` or `bf16:kv_cache_dtype=int8`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from octavo.compiler import compile_variants
from octavo.config import CompileConfig, EngineConfig
from octavo.eval.perplexity import perplexity, tokenize_text
from octavo.eval.sources import read_text
from octavo.runtime.engine import LLMEngine

VARIANTS = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "w8": "float32:quant=w8",
    "w4": "float32:quant=w4",
    "fp8": "float32:quant=fp8",
    "kv-int8": "float32:kv_cache_dtype=int8",
    "kv-fp8": "float32:kv_cache_dtype=fp8",
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_variant(text: str) -> CompileConfig:
    dtype, *options = VARIANTS.get(text, text).split(":")
    fields = {"dtype": DTYPES.get(dtype, dtype)}
    for option in options:
        key, _, value = option.partition("=")
        fields[key] = int(value) if value.isdigit() else value
    return CompileConfig(**fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default="fp32,bf16,w8,w4,fp8,kv-int8,kv-fp8")
    parser.add_argument("--texts", default="default", help="comma-separated built-in names or files")
    parser.add_argument("--max-text-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reuse", action="store_true", help="reuse artifacts already in OUT")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.variants.split(",")
    todo = [(args.out / name, parse_variant(name)) for name in names
            if not (args.reuse and (args.out / name / "manifest.json").is_file())]
    if todo:
        compile_variants(args.model, todo, overwrite=True)
    texts = args.texts.split(",")
    rows = []
    for name in names:
        engine = LLMEngine(args.out / name, EngineConfig(num_threads=args.threads, max_num_batched_tokens=2048))
        for text_name in texts:
            tokens = tokenize_text(engine.tokenizer, read_text(text_name), args.max_text_tokens)
            start = time.perf_counter()
            result = perplexity(engine, tokens)
            rows.append({"variant": name, "text": text_name, **result.as_dict(),
                         "seconds": round(time.perf_counter() - start, 1),
                         "weight_bytes": (args.out / name / "weights.safetensors").stat().st_size})
            print(json.dumps(rows[-1]), flush=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    for text_name in texts:
        print(f"\n{text_name}:\n" + table([row for row in rows if row["text"] == text_name]))
    if len(texts) > 1:
        print("\n" + spread(rows, names, texts))


def spread(rows: list[dict], names: list[str], texts: list[str]) -> str:
    """Each variant's perplexity change against the first variant, per text, and the range over the texts."""
    by = {(row["variant"], row["text"]): row["perplexity"] for row in rows}
    lines = ["| variant | " + " | ".join(texts) + " | range |", "|---" * (len(texts) + 2) + "|"]
    for name in names[1:]:
        changes = [100 * (by[name, text] / by[names[0], text] - 1) for text in texts]
        lines.append(f"| {name} | " + " | ".join(f"{change:+.1f}%" for change in changes)
                     + f" | {min(changes):+.1f}% .. {max(changes):+.1f}% |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    base = rows[0]
    bf16 = next((row for row in rows if row["variant"] == "bf16"), None)
    lines = ["| variant | perplexity | vs " + base["variant"] + " | weights on disk (MB) | vs bf16 |",
             "|---|---|---|---|---|"]
    for row in rows:
        change = 100 * (row["perplexity"] / base["perplexity"] - 1)
        ratio = f"{row['weight_bytes'] / bf16['weight_bytes']:.3f}x" if bf16 else "-"
        lines.append(f"| {row['variant']} | {row['perplexity']:.4f} | {change:+.2f}% | "
                     f"{row['weight_bytes'] / 1e6:.1f} | {ratio} |")
    lines.append(f"\n{base['tokens_scored']} tokens scored, window {base['window']}, stride {base['stride']}, "
                 f"tokens sha256 {base['tokens_sha256'][:16]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
