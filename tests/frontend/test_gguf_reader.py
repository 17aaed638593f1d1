"""One GGUF parse per load: the shared reader gives transformers exactly what its own readers give."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from transformers import AutoConfig, AutoTokenizer
from transformers import modeling_gguf_pytorch_utils as transformers_gguf

from octavo.frontend import load_model
from octavo.frontend.gguf_reader import read_gguf, sharing
from octavo.frontend.sources import bundled_model_path


@pytest.fixture(scope="module")
def smollm2_path():
    return bundled_model_path("smollm2-135m")


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """Every gguf.GGUFReader actually built (shared ones are handed out without a new parse)."""
    built: list[str] = []
    original_init = gguf.GGUFReader.__init__

    def counting_init(self, path, *args, **kwargs):
        built.append(str(path))
        original_init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting_init)
    return built


def test_read_gguf_has_the_fields_and_tensors_of_ggufs_reader(smollm2_path):
    ours, reference = read_gguf(smollm2_path), gguf.GGUFReader(smollm2_path)
    assert list(ours.fields) == list(reference.fields)
    for name, field in reference.fields.items():
        mine = ours.fields[name]
        assert (mine.data, mine.types) == (field.data, field.types), name
        pairs = zip(mine.parts, field.parts, strict=True)
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in pairs), name
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist()) for t in reference.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, reference.tensors, strict=True))


def test_a_gguf_source_is_parsed_once_and_loads_what_transformers_loads(smollm2_path, parses):
    source = load_model("smollm2-135m")
    source.load_module("float32")
    assert parses == [str(smollm2_path)]
    options = {"gguf_file": smollm2_path.name, "local_files_only": True}
    reference_config = AutoConfig.from_pretrained(smollm2_path.parent, **options)
    reference_tokenizer = AutoTokenizer.from_pretrained(smollm2_path.parent, **options)
    assert len(parses) > 1  # transformers' own loaders parsed the file again (how often depends on its release)
    assert source.config.to_dict() == reference_config.to_dict()
    assert source.tokenizer.backend_tokenizer.to_str() == reference_tokenizer.backend_tokenizer.to_str()
    assert source.tokenizer.init_kwargs == reference_tokenizer.init_kwargs


def test_sharing_hands_out_copies_and_restores_the_libraries(smollm2_path, parses):
    reader = read_gguf(smollm2_path)
    originals = (gguf.GGUFReader, gguf.get_tensor_name_map, transformers_gguf.load_gguf_checkpoint)
    with sharing(reader, smollm2_path):
        assert gguf.GGUFReader(smollm2_path) is reader
        first = transformers_gguf.load_gguf_checkpoint(smollm2_path)
        first["config"]["model_type"] = "edited"
        second = transformers_gguf.load_gguf_checkpoint(smollm2_path)
    assert second["config"]["model_type"] == "llama"  # a caller's edit never reaches the next caller
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, transformers_gguf.load_gguf_checkpoint) == originals
    assert parses == [str(smollm2_path)]
