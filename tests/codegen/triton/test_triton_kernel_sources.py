"""Kernel sources in the artifact (kernels/, manifest hashes, dump dir) and their regeneration at load."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch
from torch.fx import Graph, GraphModule

from octavo.codegen.triton_backend.pointwise_codegen import generate_source, kernel_name
from octavo.codegen.triton_backend.sources import check_kernel_sources, kernel_sources, template_source
from octavo.compiler import compile_model
from octavo.config import CompileConfig, EngineConfig
from octavo.ir.artifact_format import KERNELS_DIR, MANIFEST, sha256_file
from octavo.ir.ops.fused_pointwise import Reference, encode_program
from octavo.runtime.engine import LLMEngine
from octavo.runtime.loader import load_artifact
from octavo.runtime.sampling_params import SamplingParams

LLAMA_KERNELS = {"paged_attention.py", "kv_cache_write.py", "attention_decode.py", "attention_prefill.py", "norm.py",
                 "rotary.py", "activation.py"}


@pytest.fixture(scope="module")
def compiled_with_dumps(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("kernels")
    artifact = compile_model(tiny_model_dir("llama"), root / "artifact",
                             CompileConfig(dtype="float32", dump_dir=str(root / "dumps")))
    return artifact, root / "dumps"


def copy_artifact(artifact, destination):
    shutil.copytree(artifact, destination)
    return destination


def test_artifact_holds_every_kernel_with_its_hash(compiled_with_dumps):
    artifact, _ = compiled_with_dumps
    manifest = json.loads((artifact / MANIFEST).read_text())
    files = {path.name for path in (artifact / KERNELS_DIR).iterdir()}
    assert files == set(manifest["kernels"]) == LLAMA_KERNELS
    for name, digest in manifest["kernels"].items():
        assert sha256_file(artifact / KERNELS_DIR / name) == digest
        assert (artifact / KERNELS_DIR / name).read_text() == template_source(name)
        assert manifest["files"][f"{KERNELS_DIR}/{name}"] == digest


def test_dump_dir_holds_the_same_kernels(compiled_with_dumps):
    artifact, dumps = compiled_with_dumps
    dumped = {path.name: path.read_text() for path in (dumps / "kernels").iterdir()}
    assert dumped == {path.name: path.read_text() for path in (artifact / KERNELS_DIR).iterdir()}


def test_fused_pointwise_nodes_get_generated_sources():
    program = encode_program([{"op": "aten.mul.Tensor", "args": [Reference("input", 0), Reference("input", 1)]},
                              {"op": "aten.silu.default", "args": [Reference("step", 0)]}])
    graph = Graph()
    x, weight = graph.placeholder("x"), graph.placeholder("weight")
    fused = graph.call_function(torch.ops.octavo.fused_pointwise.default, ([x, weight], program))
    normed = graph.call_function(torch.ops.octavo.rms_norm.default, (fused, weight, 1e-6))
    graph.output(normed)
    sources = kernel_sources(GraphModule(torch.nn.Module(), graph))
    assert sources == {f"{kernel_name(program)}.py": generate_source(program), "norm.py": template_source("norm.py")}


def test_a_changed_kernel_is_reported_not_fatal(compiled_with_dumps, tmp_path, caplog):
    artifact = copy_artifact(compiled_with_dumps[0], tmp_path / "artifact")
    manifest = json.loads((artifact / MANIFEST).read_text())
    manifest["kernels"]["attention_decode.py"] = hashlib.sha256(b"another code generator").hexdigest()
    (artifact / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        loaded = load_artifact(artifact)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any("attention_decode.py" in message and "another code generator version" in message
               for message in warnings), warnings
    assert not any("norm.py" in message for message in warnings)
    assert check_kernel_sources(loaded.graph_module, manifest) == ["attention_decode.py"]


def test_loading_never_runs_the_artifacts_kernels(compiled_with_dumps, tmp_path, device):
    # kernels/ files that raise on import, with the checksums updated so that verification passes:
    # the engine still loads and runs, on the kernels the installed code generator produces.
    artifact = copy_artifact(compiled_with_dumps[0], tmp_path / "artifact")
    manifest = json.loads((artifact / MANIFEST).read_text())
    for name in manifest["kernels"]:
        (artifact / KERNELS_DIR / name).write_text('raise RuntimeError("an artifact kernel was imported")\n')
        manifest["files"][f"{KERNELS_DIR}/{name}"] = sha256_file(artifact / KERNELS_DIR / name)
    (artifact / MANIFEST).write_text(json.dumps(manifest))
    tokens = []
    for path in (compiled_with_dumps[0], artifact):
        engine = LLMEngine(path, EngineConfig(backend="triton", device=device.type, num_kv_blocks=16))
        engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished_requests():
            outputs = engine.step()
        tokens.append(outputs[0].outputs[0].token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 2


def test_sources_need_no_triton():
    # The artifact writer runs on machines without Triton: block its import and produce a kernel's text.
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "from octavo.codegen.triton_backend.sources import template_source\n"
        "from octavo.codegen.triton_backend.pointwise_codegen import generate_source\n"
        "print(len(template_source('norm.py')) > 0, 'tl.store' in generate_source("
        "'[{\"op\": \"aten.neg.default\", \"args\": [{\"input\": 0}]}]'))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]
