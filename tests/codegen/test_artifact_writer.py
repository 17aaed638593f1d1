"""The artifact writer: an artifact directory appears whole or not at all, with checksums and readable modes."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from transformers import GenerationConfig, PreTrainedTokenizerFast

import octavo.codegen.artifact as artifact_module
from octavo.codegen.artifact import FORMAT_VERSION, write_artifact
from octavo.errors import ArtifactError

EXPECTED_FILES = {"graph.onnx", "weights.safetensors", "kernels/fused_0.py", "tokenizer/tokenizer.json",
                  "tokenizer/tokenizer_config.json", "tokenizer/generation_config.json"}


@pytest.fixture(scope="module")
def tokenizer():
    vocabulary = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    model = Tokenizer(WordLevel(vocabulary, unk_token="<unk>"))
    model.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def graph_module() -> GraphModule:
    return make_fx(lambda x, w: torch.nn.functional.linear(x, w).relu(), tracing_mode="fake")(
        torch.zeros(3, 4), torch.zeros(5, 4))


def contents(generation: str, graph_module: GraphModule, tokenizer) -> dict:
    """write_artifact's arguments; `generation` marks which write produced the files."""
    return {
        "graph_module": graph_module,
        "input_specs": {"x_1": (torch.float32, ["T", 4])},
        "weights": {"w_1": torch.full((5, 4), 0.5)},
        "manifest": {"source": {"name": "tiny"}, "generation": generation},
        "tokenizer": tokenizer,
        "generation_config": GenerationConfig(eos_token_id=2),
        "kernels": {"fused_0.py": f"# generated kernel of {generation}\n"},
    }


def relative_files(root) -> set[str]:
    return {path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file()}


def test_writes_every_file_with_its_sha256(tmp_path, graph_module, tokenizer):
    target = write_artifact(tmp_path / "artifact", **contents("first", graph_module, tokenizer))
    assert target == (tmp_path / "artifact").resolve()
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["generation"] == "first" and manifest["source"] == {"name": "tiny"}
    assert set(manifest["files"]) >= EXPECTED_FILES
    assert set(manifest["files"]) == relative_files(target) - {"manifest.json"}
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((target / name).read_bytes()).hexdigest() == digest, name
    assert (target / "kernels" / "fused_0.py").read_text() == "# generated kernel of first\n"
    assert os.listdir(tmp_path) == ["artifact"]  # no staging directory left next to it


def test_permissions_follow_the_umask(tmp_path, graph_module, tokenizer):
    previous = os.umask(0o022)
    try:
        target = write_artifact(tmp_path / "artifact", **contents("first", graph_module, tokenizer))
    finally:
        os.umask(previous)
    for path in [target, *target.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o755 if path.is_dir() else 0o644), f"{path}: {oct(mode)}"


def test_existing_target_is_refused_without_overwrite(tmp_path, graph_module, tokenizer):
    target = write_artifact(tmp_path / "artifact", **contents("first", graph_module, tokenizer))
    with pytest.raises(ArtifactError, match="already exists; pass --overwrite"):
        write_artifact(target, **contents("second", graph_module, tokenizer))
    assert json.loads((target / "manifest.json").read_text())["generation"] == "first"
    assert os.listdir(tmp_path) == ["artifact"]


def test_overwrite_replaces_the_artifact(tmp_path, graph_module, tokenizer):
    target = write_artifact(tmp_path / "artifact", **contents("first", graph_module, tokenizer))
    (target / "kernels" / "stale.py").write_text("# from an older compile\n")
    write_artifact(target, **contents("second", graph_module, tokenizer), overwrite=True)
    assert json.loads((target / "manifest.json").read_text())["generation"] == "second"
    assert not (target / "kernels" / "stale.py").exists()  # replaced, not merged
    assert os.listdir(tmp_path) == ["artifact"]


def test_overwrite_refuses_a_directory_that_is_not_an_artifact(tmp_path, graph_module, tokenizer):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="is not an Octavo artifact; refusing to replace it"):
        write_artifact(target, **contents("first", graph_module, tokenizer), overwrite=True)
    assert (target / "notes.txt").read_text() == "keep me"


def test_missing_directories_above_the_artifact_are_made(tmp_path, graph_module, tokenizer):
    target = write_artifact(tmp_path / "out" / "models" / "artifact", **contents("first", graph_module, tokenizer))
    assert json.loads((target / "manifest.json").read_text())["generation"] == "first"
    assert os.listdir(tmp_path / "out" / "models") == ["artifact"]


def test_a_file_above_the_artifact_is_refused_naming_it(tmp_path, graph_module, tokenizer):
    (tmp_path / "notes").write_text("a file, not a directory")
    with pytest.raises(ArtifactError, match=f"cannot write .*: {tmp_path / 'notes'} is not a directory"):
        write_artifact(tmp_path / "notes" / "sub" / "artifact", **contents("first", graph_module, tokenizer))
    assert os.listdir(tmp_path) == ["notes"]


def test_a_place_nothing_can_be_written_in_is_an_artifact_error(graph_module, tokenizer):
    """Linux's /proc takes no new entries, whoever asks (root too)."""
    with pytest.raises(ArtifactError, match="cannot write /proc/octavo-artifact: No such file or directory"):
        write_artifact("/proc/octavo-artifact", **contents("first", graph_module, tokenizer))


def unserializable_graph() -> GraphModule:
    """A graph graph.onnx cannot store (a call_module node)."""
    return torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 5)))


def shared_weights() -> dict:
    """Two names over one storage: safetensors refuses them, after graph.onnx was already written."""
    tensor = torch.zeros(5, 4)
    return {"w_1": tensor, "alias": tensor}


@pytest.mark.parametrize("failure", ["graph", "weights"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_failure_midway_leaves_nothing_behind(tmp_path, graph_module, tokenizer, failure, overwrite):
    target = tmp_path / "artifact"
    if overwrite:
        write_artifact(target, **contents("first", graph_module, tokenizer))
    arguments = contents("second", graph_module, tokenizer)
    if failure == "graph":
        arguments["graph_module"] = unserializable_graph()
        arguments["input_specs"] = {}
    else:
        arguments["weights"] = shared_weights()
    expected = (ArtifactError, "call_module") if failure == "graph" else (RuntimeError, "share memory")
    with pytest.raises(expected[0], match=expected[1]):
        write_artifact(target, **arguments, overwrite=overwrite)
    if overwrite:  # the previous artifact is untouched
        assert os.listdir(tmp_path) == ["artifact"]
        assert json.loads((target / "manifest.json").read_text())["generation"] == "first"
    else:
        assert os.listdir(tmp_path) == []


def test_failed_final_rename_restores_the_previous_artifact(tmp_path, graph_module, tokenizer, monkeypatch):
    """If moving the new artifact into place fails, the old one must be back under its name."""
    target = write_artifact(tmp_path / "artifact", **contents("first", graph_module, tokenizer))
    real_rename = os.rename

    def rename(source, destination):
        if str(source).endswith(".partial"):
            raise OSError("simulated failure moving the new artifact into place")
        real_rename(source, destination)

    monkeypatch.setattr(artifact_module.os, "rename", rename)
    with pytest.raises(OSError, match="simulated failure"):
        write_artifact(target, **contents("second", graph_module, tokenizer), overwrite=True)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["artifact"]
    assert json.loads((target / "manifest.json").read_text())["generation"] == "first"


def test_interrupt_midway_leaves_nothing_behind(tmp_path, graph_module, tokenizer):
    """KeyboardInterrupt (not an Exception) while writing also removes the staging directory."""

    class Interrupting(GenerationConfig):
        def save_pretrained(self, *args, **kwargs):
            raise KeyboardInterrupt

    arguments = contents("first", graph_module, tokenizer)
    arguments["generation_config"] = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        write_artifact(tmp_path / "artifact", **arguments)
    assert os.listdir(tmp_path) == []
