"""Draft-model proposer: the tokenizer check, and a draft cache that follows the target through rollbacks.

A draft whose cache were not rolled back (or rolled back too far) would still let the target emit
the right tokens (the target verifies everything), but its proposals would be wrong. So the check is
on the proposals themselves: every verified proposal must be the draft model's own greedy
continuation of the target's tokens at that step, computed from scratch by a plain engine.
"""

from __future__ import annotations

import pytest

from octavo.config import EngineConfig
from octavo.errors import OctavoError
from octavo.runtime.engine import LLMEngine
from octavo.runtime.loader import load_artifact
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import greedy, run_to_completion
from tests.runtime.spec_decode.test_speculator import assert_draft_pool_full, repetitive_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_PROPOSED = 3


def test_a_draft_with_another_tokenizer_is_refused(artifact, small_vocab_artifact):
    refusal = r"does not share the target's tokenizer \(vocab size 16 vs the target's 49152\)"
    with pytest.raises(OctavoError, match=refusal):
        LLMEngine(artifact, EngineConfig(num_kv_blocks=16, speculative=f"draft:{small_vocab_artifact(0)}:2"))


def test_proposals_are_the_draft_models_own_continuation_after_rollbacks(artifact, tiny_artifact):
    draft_path = tiny_artifact("qwen2")
    engine = LLMEngine(artifact, EngineConfig(num_kv_blocks=32, speculative=f"draft:{draft_path}:{NUM_PROPOSED}:fixed"))
    reference = LLMEngine(load_artifact(draft_path), EngineConfig(num_kv_blocks=32))
    for index, prompt in enumerate(repetitive_prompts()[1:3]):
        engine.add_request(prompt, greedy(30), request_id=str(index))
    checked = 0
    while engine.has_unfinished_requests():
        before = {id(seq): list(seq.token_ids) for seq in engine.scheduler.running}
        engine.step()
        for item in engine.last_step.schedule.scheduled:
            if item.spec_token_ids:
                reference.add_request(before[id(item.seq)], greedy(len(item.spec_token_ids)), request_id="ref")
                assert item.spec_token_ids == run_to_completion(reference)["ref"].outputs[0].token_ids
                checked += 1
    metrics = engine.get_metrics().speculative
    assert checked == metrics.num_verifications >= 20
    assert metrics.accepted_tokens < metrics.proposed_tokens  # rejections happened (and were rolled back)
    assert_pool_full(engine)
    assert_draft_pool_full(engine)
