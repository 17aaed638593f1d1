"""EngineConfig refuses values no engine can run with, naming the field, before anything loads."""

from __future__ import annotations

import pytest

from octavo.config import EngineConfig
from octavo.errors import OctavoError


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_threads", 0, "num_threads must be >= 1, got 0"),
    ("max_model_len", -5, "max_model_len must be >= 1, got -5"),
    ("num_kv_blocks", 0, "num_kv_blocks must be >= 1, got 0"),
    ("max_num_seqs", 0, "max_num_seqs must be >= 1, got 0"),
    ("collective_timeout", float("nan"), "collective_timeout must be > 0 seconds, got nan"),
    ("rendezvous_timeout", -1.0, "rendezvous_timeout must be > 0 seconds, got -1.0"),
])
def test_a_value_out_of_range_is_refused_naming_the_field(field, value, message):
    with pytest.raises(OctavoError) as refused:
        EngineConfig(**{field: value})
    assert str(refused.value) == message


@pytest.mark.parametrize("field", ["num_threads", "max_model_len", "num_kv_blocks"])
def test_unset_and_positive_values_are_taken(field):
    assert getattr(EngineConfig(**{field: None}), field) is None
    assert getattr(EngineConfig(**{field: 1}), field) == 1
