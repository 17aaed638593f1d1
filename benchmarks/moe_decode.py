"""Decode of a mixture of experts against a dense model with its active parameter count, on the CPU.

Two random-weight models of one shape (hidden size, layers, heads, the bundled tokenizer's
vocabulary) are compiled and run by the same engine:

- a Qwen3-MoE with ``--experts`` experts of intermediate size ``--expert-intermediate``, ``--top-k``
  of them per token;
- a Qwen3 whose dense MLP has intermediate size ``top_k * expert_intermediate``: the same MLP
  weights read per token as the MoE's chosen experts (its "active parameters").

Each runs ``--batch`` sequences (prompts of ``--prompt`` tokens, greedy, EOS ignored) for
``--tokens`` decode steps; the median decode step (ms) of each and their ratio are printed, then
`octavo bench --profile`'s split of one MoE decode step (router, permutation, expert GEMMs). Speed
does not depend on the weights' values, so random weights measure what a real checkpoint of the
shape would. Run it on a quiet machine (timings on a shared one mean little):

    PYTHONPATH=$PWD python benchmarks/moe_decode.py --threads 8
    PYTHONPATH=$PWD python benchmarks/moe_decode.py --threads 8 --batch 8 --dtype bfloat16
    PYTHONPATH=$PWD python benchmarks/moe_decode.py --quant w8 --threads 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from octavo.bench.profile import split_model_time
from octavo.compiler import compile_model
from octavo.config import CompileConfig, EngineConfig
from octavo.frontend import load_model
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams


def model_configs(args: argparse.Namespace, vocab_size: int) -> dict:
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = {"vocab_size": vocab_size, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": args.hidden // 64, "num_key_value_heads": max(1, args.hidden // 256),
              "head_dim": 64, "max_position_embeddings": 4096, "tie_word_embeddings": True}
    return {
        "moe": Qwen3MoeConfig(**common, num_experts=args.experts, num_experts_per_tok=args.top_k,
                              moe_intermediate_size=args.expert_intermediate, norm_topk_prob=True),
        "dense": Qwen3Config(**common, intermediate_size=args.top_k * args.expert_intermediate),
    }


def build(config, directory: Path, tokenizer, args: argparse.Namespace) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    model.save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    return compile_model(directory / "model", directory / "artifact",
                         CompileConfig(dtype=args.dtype, quant=args.quant))


def decode_steps(artifact: Path, args: argparse.Namespace) -> tuple[list[float], LLMEngine]:
    engine = LLMEngine(artifact, EngineConfig(num_kv_blocks=64 * args.batch, max_num_seqs=args.batch))
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_tokens=args.tokens + 4, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request(torch.randint(100, 40000, (args.prompt,), generator=generator).tolist(), params)
    while any(seq.num_output_tokens == 0 for request in engine.requests.values() for seq in request.sequences):
        engine.step()
    seconds = []
    for _ in range(args.tokens):
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    return seconds, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-intermediate", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quant", default="none")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_model("smollm2-135m").tokenizer
    medians = {}
    with tempfile.TemporaryDirectory() as root:
        for name, config in model_configs(args, len(tokenizer)).items():
            artifact = build(config, Path(root) / name, tokenizer, args)
            seconds, engine = decode_steps(artifact, args)
            medians[name] = statistics.median(seconds)
            print(f"{name}: decode step {medians[name] * 1e3:.2f} ms (batch {args.batch}, median of {args.tokens})")
            if name == "moe":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler, \
                        engine.phases.record():
                    engine.step()
                parts, total = split_model_time(profiler.events())
                print("  one step under torch.profiler, " + ", ".join(
                    f"{part} {value * 1e3:.2f} ms ({value / total:.0%})" for part, value in parts.items()))
    print(f"moe / dense: {medians['moe'] / medians['dense']:.2f}x (target: at most 1.3x)")


if __name__ == "__main__":
    main()
