"""The package's public names: `from octavo import *` gives every name of `__all__`, each the real object."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import octavo
from octavo.config import CompileConfig, EngineConfig
from octavo.llm import LLM
from octavo.runtime.beam_search import BeamSearchParams
from octavo.runtime.outputs import CompletionOutput, RequestOutput
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.structured import StructuredOutputs

README = Path(__file__).resolve().parent.parent / "README.md"


def test_star_import_binds_every_public_name():
    namespace: dict = {}
    exec("from octavo import *", namespace)  # what a user's `import *` runs
    missing = [name for name in octavo.__all__ if name not in namespace]
    assert not missing, f"`from octavo import *` does not bind {missing}"
    expected = {"LLM": LLM, "BeamSearchParams": BeamSearchParams, "CompileConfig": CompileConfig,
                "EngineConfig": EngineConfig, "CompletionOutput": CompletionOutput, "RequestOutput": RequestOutput,
                "SamplingParams": SamplingParams, "StructuredOutputs": StructuredOutputs}
    assert set(octavo.__all__) == {*expected, "compile_model", "load"}
    for name, value in expected.items():
        assert namespace[name] is value, name
    assert callable(namespace["compile_model"]) and callable(namespace["load"])


def test_star_import_in_a_fresh_interpreter():
    """A fresh process imports nothing of octavo before the star import (no earlier import hides a missing one)."""
    names = ", ".join(octavo.__all__)
    result = subprocess.run([sys.executable, "-c", f"from octavo import *; print([{names}])"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_every_octavo_name_the_readme_uses_is_public():
    used = set(re.findall(r"\boctavo\.([A-Za-z_]\w*)\(", README.read_text()))
    assert used, "the README shows no octavo.X( calls"
    assert used <= set(octavo.__all__), f"README uses {sorted(used - set(octavo.__all__))}, not in octavo.__all__"


def test_import_octavo_loads_torch_only_when_a_public_name_is_used():
    """`import octavo` is light (the command line builds its parser on it); the first use of a name loads it."""
    script = ("import sys, octavo\n"
              "assert 'torch' not in sys.modules, 'import octavo loaded torch'\n"
              "assert not hasattr(octavo, 'NoSuchName')\n"
              "llm = octavo.LLM\n"
              "from octavo.llm import LLM\n"
              "assert llm is LLM and 'torch' in sys.modules and 'LLM' in dir(octavo)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
