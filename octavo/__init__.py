"""Octavo: compile Hugging Face causal LMs into serving artifacts and run them.

    import octavo
    path = octavo.compile_model("smollm2-135m", "smollm2.octavo")
    llm = octavo.LLM(path)
    print(llm.generate("Hello", octavo.SamplingParams(max_tokens=20))[0].outputs[0].text)

The public names are imported on first use: `import octavo` (and every `octavo.<module>` import,
which imports this package first) stays light, so the command line answers `--help` or a bad
argument without loading torch, and each command imports only what it runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from octavo.version import __version__ as __version__

if TYPE_CHECKING:
    from octavo.config import CompileConfig, EngineConfig
    from octavo.llm import LLM
    from octavo.runtime.beam_search import BeamSearchParams
    from octavo.runtime.outputs import CompletionOutput, RequestOutput
    from octavo.runtime.sampling_params import SamplingParams
    from octavo.runtime.structured import StructuredOutputs

_PUBLIC_MODULES = {"CompileConfig": "octavo.config", "EngineConfig": "octavo.config", "LLM": "octavo.llm",
                   "BeamSearchParams": "octavo.runtime.beam_search", "CompletionOutput": "octavo.runtime.outputs",
                   "RequestOutput": "octavo.runtime.outputs", "SamplingParams": "octavo.runtime.sampling_params",
                   "StructuredOutputs": "octavo.runtime.structured"}


def __getattr__(name: str):
    if name not in _PUBLIC_MODULES:
        raise AttributeError(f"module 'octavo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC_MODULES[name]), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC_MODULES})


def compile_model(source, output_dir, config=None, **options):
    """Compile a model source into an artifact directory; see octavo.compiler.compile_model."""
    from octavo.compiler import compile_model as _compile

    return _compile(source, output_dir, config, **options)


def load(path, **engine_options) -> LLM:
    """Load an artifact (or compile a model source into the cache) and return an LLM."""
    from octavo.llm import LLM

    return LLM(path, **engine_options)


__all__ = ["LLM", "BeamSearchParams", "CompileConfig", "CompletionOutput", "EngineConfig", "RequestOutput",
           "SamplingParams", "StructuredOutputs", "compile_model", "load"]
