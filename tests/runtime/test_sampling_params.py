"""SamplingParams: vLLM's defaults, normalizations and validation rules."""

import logging

import pytest

from octavo.errors import OctavoError, RequestError
from octavo.runtime.sampling_params import SamplingParams


def test_defaults_match_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.seed is None and params.logprobs is None and params.prompt_logprobs is None
    assert params.stop == [] and params.stop_token_ids == []
    assert params.max_tokens == 16 and params.min_tokens == 0
    assert not params.include_stop_str_in_output and not params.ignore_eos
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert params.logit_bias is None
    assert not params.is_greedy


@pytest.mark.parametrize(
    ("changes", "field_name"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # > max_tokens=16
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -3}, "prompt_logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": "7"}, "seed"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: "x"}}, "logit_bias"),
        ({"logit_bias": {-4: 1.0}}, "logit_bias"),
        ({"temperature": 0.0, "n": 2}, "n"),  # vLLM: greedy sampling needs n == 1
    ],
)
def test_invalid_values_raise_request_error_naming_the_field(changes, field_name):
    with pytest.raises(RequestError) as raised:
        SamplingParams(**changes)
    message = str(raised.value)
    assert isinstance(raised.value, OctavoError)
    assert f"SamplingParams.{field_name} " in message
    assert "\n" not in message
    bad_value = changes[field_name]
    if field_name not in ("stop", "stop_token_ids", "logit_bias"):
        assert repr(bad_value) in message


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": 0.0},
        {"temperature": 2.5},
        {"top_p": 1e-6},
        {"top_k": 1},
        {"top_k": -1},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"max_tokens": None, "min_tokens": 1000},
        {"max_tokens": 5, "min_tokens": 5},
        {"logprobs": 0, "prompt_logprobs": 0},
        {"n": 4, "seed": 0},
    ],
)
def test_boundary_values_are_accepted(changes):
    params = SamplingParams(**changes)
    for name, value in changes.items():
        if name != "top_k":
            assert getattr(params, name) == value


def test_normalizations():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(logprobs=True).logprobs == 1
    clamped = SamplingParams(logit_bias={"12": 3, 7: -500.0, 8: 250}).logit_bias
    assert clamped == {12: 3.0, 7: -100.0, 8: 100.0}


def test_tiny_temperature_is_raised_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="octavo.runtime.sampling_params"):
        params = SamplingParams(temperature=1e-3)
    assert params.temperature == 1e-2
    assert not params.is_greedy
    assert "temperature" in caplog.text


def test_greedy_resets_truncation_knobs():
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert params.is_greedy
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    # As in vLLM, positive temperatures are first raised to 0.01, so only 0 means greedy.
    assert not SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


def test_max_stop_string_length():
    assert SamplingParams().max_stop_string_length == 0
    assert SamplingParams(stop=["a", "four", "xy"]).max_stop_string_length == 4


def test_clone_applies_changes_and_revalidates():
    original = SamplingParams(stop=["x"], logit_bias={1: 2.0}, temperature=0.7)
    copy = original.clone(max_tokens=3, seed=11)
    assert (copy.max_tokens, copy.seed, copy.temperature, copy.stop) == (3, 11, 0.7, ["x"])
    copy.stop.append("y")
    copy.logit_bias[2] = 1.0
    assert original.stop == ["x"] and original.logit_bias == {1: 2.0}
    assert original.clone() == original
    with pytest.raises(RequestError, match=r"SamplingParams\.top_p"):
        original.clone(top_p=2.0)


def test_verify_token_ids_against_vocab():
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).verify_token_ids(10)
    with pytest.raises(RequestError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).verify_token_ids(10)
    with pytest.raises(RequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[12]).verify_token_ids(10)
