"""The ranks of a parallel engine run the compiled (AOTInductor) executor, one package per rank.

Each rank compiles its own program (its shard of the weights is frozen into
the library), keyed by the artifact, its position and the world size. The
collectives in the compiled code name their group logically ("tp") and find
the process group when they run, so nothing of one launch's process groups
is in the package.

Tolerance: the compiled graph fuses the norms and runs its linears on
oneDNN's prepacked GEMMs, whose float32 sums are ordered differently from the
eager graph's, and sharding reorders the sums of the row-parallel linears;
over two layers that moves logits of magnitude < 10 by well under 1e-4 (the
bound the compiled executor meets against Hugging Face in
tests/test_architectures.py), while a wrong shard, row or slot moves them by
more than 0.1.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from octavo.bench.profile import profiled_step
from octavo.config import EngineConfig
from octavo.parallel import create_engine
from octavo.runtime.loader import load_artifact
from tests.runtime.engine_helpers import greedy, make_engine, random_tokens

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
POOL = {"num_kv_blocks": 32, "max_num_batched_tokens": 48, "max_num_seqs": 4, "num_threads": 1}


def test_compiled_ranks_compute_the_single_process_logits(tiny_artifact, monkeypatch, tmp_path):
    # A cache of its own: the session's may hold these very packages already, from another test.
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    artifact = load_artifact(tiny_artifact("llama"))
    executor_cache = tmp_path / "executor"
    reference = make_engine(artifact, **POOL)  # the eager single-process engine
    engine = create_engine(artifact, EngineConfig(**POOL, tensor_parallel_size=2, executor="compiled"))
    try:
        assert engine.executor_kind == "compiled on 2 ranks"
        rng = random.Random(0)
        for index, length in enumerate((40, 9, 23)):
            prompt = random_tokens(rng, length)
            for each in (reference, engine):
                each.add_request(prompt, greedy(10), request_id=str(index))
        finals: dict[str, dict] = {"reference": {}, "parallel": {}}
        while reference.has_unfinished_requests() or engine.has_unfinished_requests():
            for name, each in (("reference", reference), ("parallel", engine)):
                for output in each.step():
                    if output.finished:
                        finals[name][output.request_id] = output.outputs[0].token_ids
            torch.testing.assert_close(engine.last_step.logits, reference.last_step.logits, rtol=0, atol=ATOL)
        assert finals["parallel"] == finals["reference"]
        engine.add_request(random_tokens(rng, 30), greedy(1))
        parts, _ = profiled_step(engine)  # what `octavo bench --profile` reports
        assert parts["collectives"] > 0 and parts["linears"] > 0
    finally:
        engine.shutdown()
    packages = sorted(executor_cache.iterdir())
    assert len(packages) == 2  # rank 0's and rank 1's
    for package in packages:
        targets = [node["node"]["target"] for node in json.loads((package / "model.json").read_text())["nodes"]]
        groups = {argument["arg"]["as_string"] for node in json.loads((package / "model.json").read_text())["nodes"]
                  if node["node"]["target"].startswith("octavo_rank::") for argument in node["node"]["inputs"]
                  if argument["name"] == "group"}
        assert targets.count("octavo_rank::all_reduce") == 5 and targets.count("octavo_rank::all_gather") == 1
        assert groups == {"tp"}
        assert not any("c10d" in target for target in targets)
