"""/metrics of a server with speculative decoding: proposals, acceptance and speed, as the engine counts them."""

from __future__ import annotations

import httpx

from tests.serve.server_process import running_server, scrape_metrics

PROMPT = "one two three four one two three four one two three four one two"


def test_metrics_report_speculative_decoding(tiny_llama_artifact, tmp_path):
    with running_server(tiny_llama_artifact, tmp_path, "--num-kv-blocks", "64", "--max-model-len", "128",
                        "--speculative", "ngram:3:fixed") as server:
        body = {"model": server.model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        metrics = scrape_metrics(server.url)
    proposed = metrics["octavo_spec_decode_num_draft_tokens_total"]
    accepted = metrics["octavo_spec_decode_num_accepted_tokens_total"]
    drafts = metrics["octavo_spec_decode_num_drafts_total"]
    assert 0 < accepted <= proposed and drafts > 0
    assert metrics["octavo_spec_decode_acceptance_rate"] == accepted / proposed
    assert metrics["octavo_spec_decode_num_emitted_tokens_total"] == accepted + drafts
    per_position = [value for name, value in metrics.items()
                    if name.startswith("octavo_spec_decode_num_accepted_tokens_per_pos_total")]
    assert sum(per_position) == accepted
    assert metrics["octavo_spec_decode_speedup"] > 0
