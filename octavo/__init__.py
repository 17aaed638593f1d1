"""Octavo: compile Hugging Face causal LMs into serving artifacts and run them.

    import octavo
    path = octavo.compile_model("smollm2-135m", "smollm2.octavo")
    llm = octavo.LLM(path)
    print(llm.generate("Hello", octavo.SamplingParams(max_tokens=20))[0].outputs[0].text)
"""

from octavo.config import CompileConfig, EngineConfig
from octavo.llm import LLM
from octavo.runtime.beam_search import BeamSearchParams
from octavo.runtime.outputs import CompletionOutput, RequestOutput
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.structured import StructuredOutputs
from octavo.version import __version__ as __version__


def compile_model(source, output_dir, config=None, **options):
    """Compile a model source into an artifact directory; see octavo.compiler.compile_model."""
    from octavo.compiler import compile_model as _compile

    return _compile(source, output_dir, config, **options)


def load(path, **engine_options) -> LLM:
    """Load an artifact (or compile a model source into the cache) and return an LLM."""
    return LLM(path, **engine_options)


__all__ = ["LLM", "BeamSearchParams", "CompileConfig", "CompletionOutput", "EngineConfig", "RequestOutput",
           "SamplingParams", "StructuredOutputs", "compile_model", "load"]
