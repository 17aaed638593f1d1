"""Architecture features: named from the config, refused before tracing when Octavo cannot compile them.

Refusals are checked through load_model on a model directory (config.json and an empty weights file):
the error comes before any weight, tokenizer or trace is touched, in one line naming the feature.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from octavo.errors import UnsupportedArchitectureError
from octavo.frontend import load_model
from octavo.frontend.features import architecture_features
from tests.conftest import run_cli
from tests.tiny_models import TINY_ATTENTION_SOFT_CAP, TINY_FINAL_SOFT_CAP, TINY_WINDOW, tiny_config


def model_directory(tmp_path, model_type: str, **changes):
    config = tiny_config(model_type).to_dict()
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({}, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize(("model_type", "changes", "named"), [
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_type 'dynamic'"),
    ("llama", {"hidden_act": "relu2"}, "MLP activation 'relu2'"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_unsupported_features_are_refused_in_one_line_naming_them(tmp_path, model_type, changes, named):
    directory = model_directory(tmp_path, model_type, **changes)
    with pytest.raises(UnsupportedArchitectureError) as error:
        load_model(directory)
    message = str(error.value)
    assert named in message and "\n" not in message


def test_gemma2_features_name_caps_windows_and_norms():
    features = {feature.name: feature for feature in architecture_features(tiny_config("gemma2"))}
    assert f"{TINY_ATTENTION_SOFT_CAP}" in features["attention logit soft-cap"].detail
    assert features["attention logit soft-cap"].ops == "octavo.paged_attention(soft_cap)"
    assert f"{TINY_FINAL_SOFT_CAP}" in features["final logit soft-cap"].detail
    assert features["sliding-window attention"].detail == f"window {TINY_WINDOW} on layers 0"
    assert {"(1 + w) RMSNorm", "pre- and post-norms", "scaled embeddings", "GELU gated MLP"} <= set(features)


def test_plain_llama_has_no_features_but_its_rope_scaling():
    assert [feature.name for feature in architecture_features(tiny_config("llama"))] == ["rope scaling llama3"]


def test_phi3_features_name_longrope_and_partial_rotary():
    features = {feature.name: feature for feature in architecture_features(tiny_config("phi3"))}
    assert "rope scaling longrope" in features and "fused qkv and gate/up projections" in features
    assert features["partial rotary"].detail == "the first 12 of 16 dims of each head"


def test_inspect_prints_the_features_and_their_ops(tiny_artifact):
    result = run_cli("inspect", str(tiny_artifact("gemma2")))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "soft-cap" in line]
    assert any("attention logit soft-cap" in line and "octavo.paged_attention(soft_cap) (2 nodes)" in line
               for line in lines), result.stdout
    assert any("final logit soft-cap" in line for line in lines)
