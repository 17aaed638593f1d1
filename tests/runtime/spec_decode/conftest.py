"""Fixtures of the speculative decoding tests: small-vocabulary artifacts and engine runners."""

from __future__ import annotations

import pytest

from tests.runtime.spec_decode.small_vocab import write_small_vocab_model


@pytest.fixture(scope="session")
def small_vocab_artifact(tmp_path_factory):
    """Factory: the compiled small-vocabulary llama with weights from `seed` (cached per session)."""
    from octavo.compiler import compile_model
    from octavo.config import CompileConfig

    made = {}

    def build(seed: int):
        if seed not in made:
            root = tmp_path_factory.mktemp(f"small-vocab-{seed}")
            made[seed] = compile_model(write_small_vocab_model(root / "model", seed), root / "artifact",
                                       CompileConfig(dtype="float32"))
        return made[seed]

    return build
