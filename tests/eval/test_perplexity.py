"""Windowed perplexity through the engine: every token scored once, equal to Hugging Face's on the same windows."""

from __future__ import annotations

import json
import math

import pytest
import torch

from octavo.config import EngineConfig
from octavo.errors import OctavoError
from octavo.eval.perplexity import perplexity, plan_windows
from octavo.runtime.engine import LLMEngine
from tests.conftest import assert_pool_full, run_cli


@pytest.mark.parametrize(("num_tokens", "window", "stride"), [(1000, 512, 256), (512, 512, 256), (513, 512, 256),
                                                               (90, 32, 32), (37, 8, 3), (2, 512, 256)])
def test_every_token_but_the_first_is_scored_exactly_once(num_tokens, window, stride):
    windows = plan_windows(num_tokens, window, stride)
    scored = [position for item in windows for position in range(item.end - item.scored, item.end)]
    assert scored == list(range(1, num_tokens))
    assert all(item.end - item.start <= window and item.start % stride == 0 for item in windows)
    assert windows[0].scored == min(window, num_tokens) - 1 and windows[-1].end == num_tokens


@pytest.mark.parametrize(("num_tokens", "window", "stride", "message"), [
    (1, 512, 256, "at least 2"), (100, 1, 1, "window >= 2"), (100, 64, 65, "stride <= window")])
def test_bad_plans_are_refused(num_tokens, window, stride, message):
    with pytest.raises(OctavoError, match=message):
        plan_windows(num_tokens, window, stride)


def test_perplexity_equals_hugging_face_on_the_same_windows(tiny_artifact, tiny_model_dir, one_thread):
    from transformers import AutoModelForCausalLM

    token_ids = torch.randint(3, 49000, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = LLMEngine(tiny_artifact("llama"), EngineConfig(num_kv_blocks=64, max_num_batched_tokens=256))
    finished = []
    result = perplexity(engine, token_ids, window=128, stride=48, on_window=finished.append)
    assert_pool_full(engine)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()
    total = 0.0
    for item in plan_windows(len(token_ids), 128, 48):
        window = torch.tensor([token_ids[item.start:item.end]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(window).logits[0].double(), -1)
        targets = window[0, 1:]
        total += logprobs[:-1].gather(1, targets.unsqueeze(1))[-item.scored:].sum().item()
    assert result.tokens_scored == sum(finished) == 299
    assert result.windows == len(finished) == len(plan_windows(300, 128, 48))
    assert math.isclose(result.perplexity, math.exp(-total / 299), rel_tol=1e-4)


def test_eval_command_prints_the_perplexity_and_the_tokens_scored(tiny_artifact, tmp_path):
    text = tmp_path / "text.jsonl"
    lines = [{"text": "The quick brown fox jumps over the lazy dog. " * 3}, {"text": "Hello."}]
    text.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = run_cli("eval", str(tiny_artifact("llama")), "--perplexity", str(text), "--window", "16", "--stride",
                     "8", "--num-kv-blocks", "16")
    assert result.returncode == 0, result.stderr
    assert "perplexity " in result.stdout and " tokens scored (" in result.stdout and "windows of 16, stride 8" in (
        result.stdout)


def test_a_window_is_at_most_max_model_len_minus_1_and_the_default_fits(tiny_artifact, tmp_path, one_thread):
    """The tiny llama's max_model_len is 512, the default window's size: a window is a prompt the engine
    generates one token after, so the command's default window shrinks to 511 and an explicit 512 is refused."""
    engine = LLMEngine(tiny_artifact("llama"), EngineConfig(num_kv_blocks=64))
    assert engine.max_model_len == 512
    with pytest.raises(OctavoError, match=r"window 512 does not fit the engine's max_model_len 512: .* at most 511"):
        perplexity(engine, list(range(3, 603)), window=512)
    engine.shutdown()
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 60)
    result = run_cli("eval", str(tiny_artifact("llama")), "--perplexity", str(text), "--num-kv-blocks", "96")
    assert result.returncode == 0, result.stderr
    assert "windows of 511, stride 256" in result.stdout, result.stdout
