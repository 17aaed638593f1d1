"""Draft-model proposer: another compiled artifact with the same tokenizer proposes by decoding ahead.

The draft runs with its own executor, paged KV cache, block manager and block tables, one draft
sequence per target sequence. Before proposing, a draft sequence is brought in step with its target:
its computed tokens are cut back to the longest prefix it shares with the target's tokens (rejected
proposals are rolled back, and blocks that held only them are freed), then every pass computes its
missing tokens (chunked under the token budget) and samples the next proposal, until each sequence
has its k proposals. Proposals are drawn from the draft's own distribution with the request's
sampling parameters applied (argmax for greedy requests, then a point mass).
"""

from __future__ import annotations

import logging
import time

import torch

from octavo.errors import OctavoError
from octavo.runtime.block_manager import BlockManager
from octavo.runtime.executor import GraphExecutor, int8_activations
from octavo.runtime.input_batch import build_step_inputs
from octavo.runtime.kv_cache import KVCache
from octavo.runtime.loader import LoadedArtifact
from octavo.runtime.sampler import Sampler, SamplingRow
from octavo.runtime.scheduler import ScheduledSequence
from octavo.runtime.sequence import Sequence
from octavo.runtime.spec_decode.cost_model import StepCostModel
from octavo.runtime.spec_decode.proposer import Proposal, Proposer

logger = logging.getLogger(__name__)

DRAFT_SEED_MULTIPLIER = 0x9E3779B1
"""Seeded requests draw draft samples from their own generator, seeded apart from the target's."""


def check_same_tokenizer(target: LoadedArtifact, draft: LoadedArtifact) -> None:
    """Raise unless the draft maps text to the same token ids as the target (same vocabulary)."""
    problems = []
    if target.manifest["vocab_size"] != draft.manifest["vocab_size"]:
        problems.append(f"vocab size {draft.manifest['vocab_size']} vs the target's {target.manifest['vocab_size']}")
    else:
        target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
        if target_vocab != draft_vocab:
            differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()))[:3]
            problems.append(f"{len(set(target_vocab.items()) ^ set(draft_vocab.items()))} vocabulary entries "
                            f"differ (e.g. {differing})")
    if problems:
        raise OctavoError(f"draft artifact {draft.path} does not share the target's tokenizer ({'; '.join(problems)}): "
                          "a draft model must produce the same token ids as the target")


class DraftProposer(Proposer):
    """Proposals from a draft model (see the module docstring)."""

    name = "draft"
    free = False

    def __init__(self, draft: LoadedArtifact, backend: str, device: torch.device, num_blocks: int,
                 max_num_batched_tokens: int, seed: int):
        self.artifact = draft
        layout = draft.kv_layout
        self.block_size = layout["block_size"]
        self.max_model_len = draft.manifest["max_model_len"]
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = device
        self.executor = GraphExecutor(draft.graph_module, draft.weights, backend, device,
                                      int8_activations=int8_activations(draft.manifest))
        self.kv_cache = KVCache(layout, num_blocks, device)
        self.block_manager = BlockManager(num_blocks, self.block_size)
        self.sampler = Sampler(draft.manifest["vocab_size"], draft.eos_token_ids, seed=seed + 1)
        self.cost = StepCostModel()
        self.states: dict[Sequence, Sequence] = {}
        self._synced_length: dict[Sequence, int] = {}
        self._seconds = 0.0

    def draft_seconds(self) -> float:
        return self._seconds

    # ---- proposing ----

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        start = time.perf_counter()
        tokens: dict[Sequence, list[int]] = {seq: [] for seq in seqs}
        probs: dict[Sequence, list[torch.Tensor]] = {seq: [] for seq in seqs}
        wanted = {}
        for seq, count in zip(seqs, num_tokens, strict=True):
            count = min(count, self.max_model_len - seq.num_tokens)
            if count > 0:
                wanted[self._sync(seq)] = (seq, count)
        pending = list(wanted)
        while pending:
            scheduled = self._schedule_pass(pending)
            if not scheduled:
                break
            for draft, token, row_probs in self._run_pass(scheduled):
                seq, count = wanted[draft]
                tokens[seq].append(token)
                if row_probs is not None:
                    probs[seq].append(row_probs)
                draft.token_ids.append(token)
                if len(tokens[seq]) == count:
                    pending.remove(draft)
        self._seconds = time.perf_counter() - start
        return [Proposal(tokens[seq], torch.stack(probs[seq]) if probs[seq] else None) for seq in seqs]

    def _schedule_pass(self, pending: list[Sequence]) -> list[ScheduledSequence]:
        """Every pending draft sequence's missing tokens, as far as the budget and the blocks allow."""
        scheduled = []
        budget = self.max_num_batched_tokens
        for draft in list(pending):
            count = min(draft.num_uncomputed_tokens, budget)
            if count == 0:
                break
            needed = draft.num_computed_tokens + count
            if not self.block_manager.can_allocate(draft, needed):
                pending.remove(draft)  # the draft pool is full: this sequence proposes what it has
                continue
            self.block_manager.allocate(draft, needed)
            scheduled.append(ScheduledSequence(draft, count))
            budget -= count
        return scheduled

    def _run_pass(self, scheduled: list[ScheduledSequence]) -> list[tuple[Sequence, int, torch.Tensor | None]]:
        """One draft step; returns (draft sequence, sampled token, its distribution or None) per sampling row."""
        start = time.perf_counter()
        inputs = build_step_inputs(scheduled, self.block_size)
        logits = self.executor.run({**inputs.to(self.device).as_dict(), **self.kv_cache.tensors})
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        drafts = [scheduled[index].seq for index in inputs.sampled_rows]
        results = []
        if drafts:
            rows = [SamplingRow(draft.params, draft.prompt_token_ids, draft.output_token_ids, draft.generator)
                    for draft in drafts]
            distributions = self.sampler.distributions(logits[:len(drafts)], rows)
            greedy = distributions.greedy_token_ids.tolist()
            for index, draft in enumerate(drafts):
                if draft.params.is_greedy:
                    results.append((draft, greedy[index], None))
                    continue
                row_probs = distributions.probs[index]
                noise = self.sampler.exponential_noise(draft.generator, 1, row_probs.device)[0]
                results.append((draft, int((row_probs / noise).argmax()), row_probs))
        self.cost.observe(inputs.input_ids.numel(), sum(1 for item in scheduled if item.num_new_tokens > 1),
                          time.perf_counter() - start)
        return results

    # ---- keeping in step with the target ----

    def _sync(self, seq: Sequence) -> Sequence:
        """The draft sequence of `seq`, with its computed tokens cut to the prefix it shares with `seq`."""
        draft = self.states.get(seq)
        if draft is None:
            generator = None
            if seq.params.seed is not None:
                generator = torch.Generator().manual_seed((seq.params.seed + seq.index) * DRAFT_SEED_MULTIPLIER % 2**63)
            params = seq.params if seq.params.prompt_logprobs is None else seq.params.clone(prompt_logprobs=None)
            draft = Sequence(seq.request_id, seq.index, seq.prompt_token_ids, params, None, generator=generator)
            self.states[seq] = draft
            self._synced_length[seq] = draft.num_tokens
        # The target only appends tokens, so everything up to the last synchronized length is shared.
        common = self._synced_length[seq]
        limit = min(draft.num_tokens, seq.num_tokens)
        while common < limit and draft.token_ids[common] == seq.token_ids[common]:
            common += 1
        draft.num_computed_tokens = min(draft.num_computed_tokens, common)
        draft.token_ids[common:] = seq.token_ids[common:]
        self._synced_length[seq] = seq.num_tokens
        self.block_manager.truncate(draft, draft.num_computed_tokens)
        return draft

    def release(self, seq: Sequence) -> None:
        draft = self.states.pop(seq, None)
        self._synced_length.pop(seq, None)
        if draft is not None:
            self.block_manager.free(draft)

    def release_all_but(self, running: set[Sequence]) -> None:
        for seq in [seq for seq in self.states if seq not in running]:
            self.release(seq)


def draft_num_blocks(target_blocks: int, target_block_size: int, draft_block_size: int, max_num_seqs: int,
                     num_speculative: int) -> int:
    """A draft pool holding the target pool's tokens plus every running sequence's proposals."""
    per_sequence = -(-(num_speculative + 1) // draft_block_size)
    return -(-target_blocks * target_block_size // draft_block_size) + max_num_seqs * per_sequence
