"""The quantized SmolLM2 artifacts tests/test_quantization_smollm2.py checks, and their perplexities.

    python -m tests.smollm2_quantized DIR

compiles every variant of `variants` (fp32 among them: the reference, one trace shared by all) into
DIR/<variant>, scores each artifact on the first SLICE_TOKENS tokens of the evaluation text and writes
DIR/perplexities.json ({variant: PerplexityResult.as_dict()}). conftest runs it in the background while other
tests run (tests/background_builds.py); the test module states what the variants are for.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from octavo.config import CompileConfig

SLICE_TOKENS = 1024  # three windows of 512 at stride 256
CALIBRATION_CHARS = 20_000  # 4686 tokens of the default calibration mix: 9 runs of 512
PERPLEXITIES = "perplexities.json"
VARIANTS = ("fp32", "w8", "w8a8", "w4", "w4-vocab4", "kv-int8", "w4-g64", "w4-awq-g64", "w4-gptq-g64")


def variants(calibration: str) -> dict[str, CompileConfig]:
    """Each artifact's compile options (by VARIANTS' names); AWQ and GPTQ read the calibration file `calibration`."""
    return {"fp32": CompileConfig(dtype="float32"),
            "w8": CompileConfig(dtype="float32", quant="w8"), "w8a8": CompileConfig(dtype="float32", quant="w8a8"),
            "w4": CompileConfig(dtype="float32", quant="w4"),
            "w4-vocab4": CompileConfig(dtype="float32", quant="w4", vocab_quant="w4"),
            "kv-int8": CompileConfig(dtype="float32", kv_cache_dtype="int8"),
            "w4-g64": CompileConfig(dtype="float32", quant="w4", group_size=64),
            "w4-awq-g64": CompileConfig(dtype="float32", quant="w4-awq", group_size=64, calibration=calibration),
            "w4-gptq-g64": CompileConfig(dtype="float32", quant="w4-gptq", group_size=64, calibration=calibration,
                                         gptq_act_order=True)}


def build(directory: Path) -> None:
    """Compile every variant into `directory` and write its perplexities (see the module docstring)."""
    from octavo.compiler import compile_variants
    from octavo.config import EngineConfig
    from octavo.eval.corpus import default_text
    from octavo.eval.perplexity import perplexity, tokenize_text
    from octavo.eval.sources import calibration_text
    from octavo.frontend import load_model
    from octavo.runtime.engine import LLMEngine

    directory.mkdir(parents=True, exist_ok=True)
    calibration = directory / "calibration.txt"
    calibration.write_text(calibration_text("default")[:CALIBRATION_CHARS])
    source = load_model("smollm2-135m")
    configs = variants(str(calibration))
    assert tuple(configs) == VARIANTS
    paths = compile_variants(source, [(directory / name, config) for name, config in configs.items()])
    tokens = tokenize_text(source.tokenizer, default_text("evaluation"), SLICE_TOKENS)
    results = {}
    for name, path in zip(configs, paths, strict=True):
        engine = LLMEngine(path, EngineConfig(num_kv_blocks=128, max_num_batched_tokens=1536))
        results[name] = perplexity(engine, tokens).as_dict()
    (directory / PERPLEXITIES).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    build(Path(sys.argv[1]))
