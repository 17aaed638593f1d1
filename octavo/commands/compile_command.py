"""`octavo compile`: model -> artifact, with dumps and IR printing."""

from __future__ import annotations

import argparse
import time

from octavo.commands.common import console, error_console
from octavo.config import KV_CACHE_DTYPES, QUANT_SCHEMES, VOCAB_QUANT, CompileConfig


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("compile", help="compile a model into an artifact directory")
    parser.add_argument("model", nargs="?", default="smollm2-135m",
                        help="bundled model name, HF model directory or .gguf file (default: smollm2-135m)")
    parser.add_argument("-o", "--output", help="artifact directory to write")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="compute dtype; auto (default): bfloat16 where this CPU computes it natively "
                             "(AMX, AVX512_BF16), else float32 (quantized artifacts too)")
    parser.add_argument("--weight-dtype", choices=["bfloat16", "float16"], default=None,
                        help="store a float32 artifact's linear and embedding weights in 16 bits "
                             "(half the bytes per decode step; compute stays float32)")
    parser.add_argument("--dump-dir", help="write the graph after every pass here (also: OCTAVO_DUMP_DIR)")
    parser.add_argument("--disable-pass", action="append", default=[], metavar="PASS",
                        help="skip a pass (repeatable, or comma-separated)")
    parser.add_argument("--print-ir-after", action="append", default=[], metavar="PASS",
                        help="print the graph after this pass")
    parser.add_argument("--stop-after", metavar="PASS", help="stop the pipeline after this pass (no artifact)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--quant", choices=QUANT_SCHEMES, default="none",
                        help="weight quantization: w8 (int8 per channel), w8a8 (w8, and each linear's input "
                             "rounded to int8 at run time in groups of 64), w4 (4-bit groups, RTN), fp8 (e4m3 per "
                             "channel); w4-awq / w4-gptq calibrate; w4-awq-gptq: AWQ's scales, then GPTQ on the "
                             "scaled weights (default: none)")
    parser.add_argument("--group-size", type=int, default=None, help="w4/w8 group size along K (default: scheme's)")
    parser.add_argument("--vocab-quant", choices=VOCAB_QUANT, default="int8",
                        help="how --quant stores the embedding and lm_head: int8 per row (default), w4, or none")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="KV cache storage: auto (the model dtype), int8 or fp8 with per-token scales")
    parser.add_argument("--calibration", metavar="FILE",
                        help="calibration text (plain text or JSONL with a \"text\" field) for calibrated schemes; "
                             "default: the built-in text")
    parser.add_argument("--gptq-act-order", action="store_true",
                        help="w4-gptq, w4-awq-gptq: round columns by decreasing Hessian diagonal (group scales fixed "
                             "up front)")
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                        help="serve this PEFT LoRA adapter (repeatable): an octavo.lora op is added beside every "
                        "linear an adapter targets; the engine loads the adapters at start")
    parser.add_argument("--lora-targets", default=None, metavar="MODULES",
                        help="comma-separated module names that take adapters (default: what the --lora adapters "
                        "target), e.g. q_proj,k_proj,v_proj,o_proj to load other adapters at run time")
    parser.add_argument("--max-lora-rank", type=int, default=0, metavar="R",
                        help="the largest rank an adapter may have (default: the largest --lora adapter's)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing artifact")
    parser.add_argument("--warmup", action="store_true",
                        help="then compile the graph for this machine into the cache, as `octavo warmup` does")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: the compiler pulls in torch._dynamo, which every other command would pay for at startup.
    from octavo.codegen.cpu_backend.precision import resolve_precision
    from octavo.compiler import compile_model

    config = CompileConfig(dtype=args.dtype, weight_dtype=args.weight_dtype, block_size=args.block_size,
                           dump_dir=args.dump_dir,
                           disabled_passes=tuple(_split(args.disable_pass)),
                           print_ir_after=tuple(_split(args.print_ir_after)), stop_after=args.stop_after,
                           progress=True, quant=args.quant, group_size=args.group_size,
                           kv_cache_dtype=args.kv_cache_dtype, calibration=args.calibration,
                           gptq_act_order=args.gptq_act_order,
                           vocab_quant=args.vocab_quant, lora_adapters=tuple(args.lora),
                           lora_targets=tuple(_split([args.lora_targets] if args.lora_targets else [])),
                           max_lora_rank=args.max_lora_rank)
    config = resolve_precision(config)
    start = time.perf_counter()
    with console.status("loading model") as status:
        path = compile_model(args.model, args.output, config, overwrite=args.overwrite,
                             on_print_ir=_print_ir, on_stage=lambda message: status.update(message))
    elapsed = time.perf_counter() - start
    if path is None:
        error_console.print(f"stopped after {args.stop_after} in {elapsed:.1f}s; no artifact written")
    else:
        console.print(f"compiled {args.model} -> {path} in {elapsed:.1f}s")
        if config.dtype_choice:  # after the compile, so that bad input stays one error line
            console.print(f"dtype {config.dtype_choice}", markup=False)
        if args.warmup:
            from octavo.commands.warmup_command import warm_up
            from octavo.config import EngineConfig

            warm_up(str(path), EngineConfig())
    return 0


def _print_ir(pass_name: str, text: str) -> None:
    console.print(f"// ----- IR after {pass_name} -----", style="bold")
    console.out(text, end="")


def _split(values: list[str]) -> list[str]:
    return [item.strip() for value in values for item in value.split(",") if item.strip()]
