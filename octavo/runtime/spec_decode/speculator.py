"""The engine's speculative decoding: plan and propose before a step, verify and roll back after it."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from octavo.config import SpeculativeConfig
from octavo.errors import OctavoError
from octavo.runtime.input_batch import StepInputs
from octavo.runtime.loader import load_artifact
from octavo.runtime.sampler import SamplingDistributions, SamplingRow
from octavo.runtime.scheduler import ScheduledSequence, SchedulerOutput
from octavo.runtime.sequence import Sequence, SequenceStatus
from octavo.runtime.spec_decode.acceptance import AcceptanceTracker, ShadowChecks
from octavo.runtime.spec_decode.calibration import calibrate, calibration_shapes
from octavo.runtime.spec_decode.cost_model import StepCostModel
from octavo.runtime.spec_decode.draft import DraftProposer, check_same_tokenizer, draft_num_blocks
from octavo.runtime.spec_decode.metrics import SpecDecodeMetrics
from octavo.runtime.spec_decode.ngram import NgramProposer
from octavo.runtime.spec_decode.policy import Candidate, SpeculationPolicy, StepShape
from octavo.runtime.spec_decode.proposer import Proposal, Proposer
from octavo.runtime.spec_decode.rejection import accept_greedy, accept_point_mass, accept_sampled

logger = logging.getLogger(__name__)


class Speculator:
    """Owns the proposer, the cost models, the policy and the counters of one engine.

    The engine calls `propose()` before scheduling a step (its result goes to the scheduler, which
    fits proposals into the token budget and the free blocks) and `verify()` after the step ran and
    the other sequences sampled.
    """

    def __init__(self, engine, config: SpeculativeConfig, proposer: Proposer):
        self.engine = engine
        self.config = config
        self.proposer = proposer
        self.target_cost = StepCostModel()
        draft_cost = getattr(proposer, "cost", None)
        self.policy = SpeculationPolicy(config.num_tokens, config.adaptive, self.target_cost, draft_cost)
        self.acceptance = AcceptanceTracker()
        self.shadow = ShadowChecks()
        self.stats = SpecDecodeMetrics(proposer.name, config.num_tokens)
        self._proposals: dict[Sequence, Proposal] = {}
        self._step_start: float | None = None
        self._calibrate()  # the adaptive policy plans with it; the speedup estimate needs it either way

    def _calibrate(self) -> None:
        engine = self.engine
        shapes = calibration_shapes(self.config.num_tokens, engine.config.max_num_seqs,
                                    engine.config.max_num_batched_tokens)
        calibrate(self.target_cost, engine.executor, engine.kv_cache.tensors, engine.block_manager.num_blocks,
                  engine.block_manager.block_size, shapes, engine.device)
        draft_cost = getattr(self.proposer, "cost", None)
        if draft_cost is not None:
            proposer = self.proposer
            calibrate(draft_cost, proposer.executor, proposer.kv_cache.tensors, proposer.block_manager.num_blocks,
                      proposer.block_size, [shape for shape in shapes if shape[1] == 1], engine.device)
        logger.info("speculative cost model: target step %s", _describe(self.target_cost))

    # ---- before the step ----

    def propose(self) -> dict[Sequence, list[int]]:
        """Proposals for the running sequences that speculate this step (possibly none)."""
        self._step_start = time.perf_counter()
        scheduler = self.engine.scheduler
        running = set(scheduler.running)
        self.proposer.release_all_but(running)
        self.acceptance.forget_all_but(running)
        self.shadow.resolve(self.acceptance)
        self._proposals = {}
        candidates = [seq for seq in scheduler.running if self._may_speculate(seq)]
        if not candidates:
            return {}
        caps = [self._max_proposed(seq) for seq in candidates]
        proposals = None
        if self.proposer.free:
            proposals = self.proposer.propose(candidates, caps)
            caps = [len(proposal.token_ids) for proposal in proposals]
        rest = self._rest_of_step(len(candidates))
        counts = self.policy.plan([Candidate(self.acceptance.estimate(seq), cap) for seq, cap in zip(
            candidates, caps, strict=True)], rest)
        if self.config.adaptive and not self.proposer.free:
            self._add_probes(candidates, caps, counts, rest)
        if proposals is None:
            proposals = self.proposer.propose(candidates, counts)
        for seq, proposal, count in zip(candidates, proposals, counts, strict=True):
            if proposal.draft_probs is None:
                # A point-mass proposal the grammar forbids would be rejected for sure, and what is then
                # sampled there is the target's own distribution: stopping before it changes nothing but cost.
                count = len(self.engine.structured.check_proposals(seq, proposal.token_ids[:count]))
            if count and proposal.token_ids:
                draft_probs = proposal.draft_probs[:count] if proposal.draft_probs is not None else None
                self._proposals[seq] = Proposal(proposal.token_ids[:count], draft_probs)
            else:
                self.acceptance.idle(seq)
                if self.proposer.free:
                    self.shadow.watch(seq, proposal.token_ids)
        return {seq: proposal.token_ids for seq, proposal in self._proposals.items()}

    def _add_probes(self, candidates: list[Sequence], caps: list[int], counts: list[int], rest: StepShape) -> None:
        """Let sequences that have not verified for a while verify all their proposals (see policy); only for
        a proposer that runs a model (free proposals are judged without verification: ShadowChecks)."""
        step = StepShape(rest.tokens + len(candidates) + sum(counts), rest.multi + sum(1 for k in counts if k), 0)
        for index, seq in enumerate(candidates):
            idle = self.acceptance.idle_steps.get(seq, 0)
            if counts[index] == 0 and caps[index] > 0 and idle >= self.policy.probe_interval(caps[index], step):
                counts[index] = caps[index]

    def _may_speculate(self, seq: Sequence) -> bool:
        return (seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1 and seq.params.speculative
                and seq.detokenizer is not None)

    def _max_proposed(self, seq: Sequence) -> int:
        """k, less what max_tokens or max_model_len leave (the target adds one token of its own)."""
        left = self.engine.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        return max(0, min(self.config.num_tokens, left - 1))

    def _rest_of_step(self, num_candidates: int) -> StepShape:
        """What the step runs besides the candidates: other decodes and (an estimate of) prefill chunks."""
        scheduler = self.engine.scheduler
        decodes = sum(1 for seq in scheduler.running if seq.num_uncomputed_tokens == 1) - num_candidates
        prefill_seqs = [seq for seq in scheduler.running if seq.num_uncomputed_tokens > 1]
        budget = max(0, scheduler.max_num_batched_tokens - decodes - num_candidates)
        prefill_tokens = min(budget, sum(seq.num_uncomputed_tokens for seq in prefill_seqs))
        return StepShape(decodes + prefill_tokens, len(prefill_seqs), decodes)

    # ---- after the step ----

    def verify(self, schedule: SchedulerOutput, inputs: StepInputs, logits: torch.Tensor) -> None:
        """Accept or reject the verified proposals, append the emitted tokens, roll back the rest."""
        items = [(index, schedule.scheduled[index]) for index in inputs.spec_rows]
        emitted = verified = 0
        if items:
            emitted, verified = self._verify(items, inputs, logits)
            self.stats.num_verify_steps += 1
        self._account(schedule, inputs, emitted, verified)

    def _verify(self, items: list[tuple[int, ScheduledSequence]], inputs: StepInputs,
                logits: torch.Tensor) -> tuple[int, int]:
        row_of_sampled = {index: row for row, index in enumerate(inputs.sampled_rows)}
        rows: list[int] = []
        sampling_rows: list[SamplingRow] = []
        for index, item in items:
            seq, first = item.seq, inputs.spec_rows[index][0]
            rows += [row_of_sampled[index], *range(first, first + len(item.spec_token_ids))]
            output = seq.output_token_ids
            sampling_rows += [SamplingRow(seq.params, seq.prompt_token_ids, output + item.spec_token_ids[:j],
                                          seq.generator) for j in range(len(item.spec_token_ids) + 1)]
        row_logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        step_mask = self.engine.step_mask
        banned = step_mask.select(rows, logits.device) if step_mask is not None else None
        distributions = self.engine.sampler.distributions(row_logits, sampling_rows, banned)
        greedy = distributions.greedy_token_ids.tolist()
        decisions = []
        offset = 0
        for _, item in items:
            decisions.append(self._accept(item, distributions, greedy, offset))
            offset += len(item.spec_token_ids) + 1
        return self._apply(items, decisions, row_logits, sampling_rows)

    def _accept(self, item: ScheduledSequence, distributions: SamplingDistributions, greedy: list[int],
                offset: int) -> tuple[list[int], int, int]:
        """(emitted tokens, accepted proposals, first row) of one sequence."""
        seq, proposal = item.seq, item.spec_token_ids
        end = offset + len(proposal) + 1
        if seq.params.is_greedy:
            return (*accept_greedy(greedy[offset:end], proposal), offset)
        sampler = self.engine.sampler
        probs = distributions.probs[offset:end]

        def noise() -> torch.Tensor:
            return sampler.exponential_noise(seq.generator, 1, probs.device)[0]

        draft_probs = self._proposals[seq].draft_probs
        if draft_probs is None:
            return (*accept_point_mass(probs, proposal, noise), offset)
        uniform = lambda: sampler.uniform(seq.generator, probs.device)  # noqa: E731
        return (*accept_sampled(probs, draft_probs[:len(proposal)], proposal, noise, uniform), offset)

    def _apply(self, items, decisions, row_logits: torch.Tensor, sampling_rows: list[SamplingRow]) -> tuple[int, int]:
        """Append the emitted tokens (stopping where a stop condition ends the sequence), then roll back.

        Logprobs are those of the raw logits at each emitted token's position, as plain sampling reports.
        """
        flat_rows = [first + j for emitted, _, first in decisions for j in range(len(emitted))]
        flat_tokens = [token for emitted, _, _ in decisions for token in emitted]
        device = row_logits.device
        scores = self.engine.sampler.score_logits(row_logits[torch.tensor(flat_rows, device=device)],
                                                  torch.tensor(flat_tokens, device=device),
                                                  [sampling_rows[row] for row in flat_rows])
        logprobs = scores.sampled_logprobs.tolist()
        outputs, manager = self.engine.outputs, self.engine.block_manager
        position = total_emitted = 0
        for (_, item), (emitted, accepted, _) in zip(items, decisions, strict=True):
            seq = item.seq
            appended = 0
            for token in emitted:
                entry = (outputs.logprob_entry(scores, position + appended, seq.params.logprobs)
                         if seq.output_logprobs is not None else None)
                appended += 1
                if outputs.append_token(seq, token, logprobs[position + appended - 1], entry):
                    break
            position += len(emitted)
            total_emitted += appended
            self.stats.record(len(item.spec_token_ids), accepted, appended)
            self.acceptance.record(seq, len(item.spec_token_ids), accepted)
            if not seq.is_finished:
                # The step computed the newest token and the accepted proposals; the rejected
                # positions' slots are dropped and the blocks that held only them are freed.
                seq.num_computed_tokens += accepted
                manager.truncate(seq, seq.num_tokens)
                manager.cache_full_blocks(seq)
        return total_emitted, len(items)

    def _account(self, schedule: SchedulerOutput, inputs: StepInputs, emitted: int, verified: int) -> None:
        """Feed the step's time to the cost model and the speedup estimate."""
        if self._step_start is None:
            return
        seconds = time.perf_counter() - self._step_start
        self._step_start = None
        draft_seconds = self.proposer.draft_seconds() if self._proposals else 0.0
        tokens = inputs.input_ids.numel()
        multi = sum(1 for item in schedule.scheduled if item.num_new_tokens > 1)
        self.target_cost.observe(tokens, multi, seconds - draft_seconds)
        self.stats.speculative_seconds += seconds
        self.stats.draft_seconds += draft_seconds
        if verified:
            # A plain step would have emitted one token per sampling sequence; this one emitted
            # `emitted` for the verifying ones: the same tokens take that many plain steps.
            proposed = sum(len(item.spec_token_ids) for item in schedule.scheduled)
            plain_step = self.target_cost.predict(tokens - proposed, multi - verified)
            others = len(inputs.sampled_rows) - verified
            self.stats.estimated_plain_seconds += plain_step * (emitted + others) / (verified + others)
        else:
            self.stats.estimated_plain_seconds += seconds
        self._proposals = {}
        # Sequences that finished in this step give back what the proposer held for them now, so an
        # idle engine holds nothing.
        self.proposer.release_all_but(set(self.engine.scheduler.running))

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)
        self.acceptance.forget(seq)
        self.shadow.forget(seq)

    def metrics(self) -> SpecDecodeMetrics:
        """A snapshot of the counters (a copy: the engine keeps counting)."""
        return dataclasses.replace(self.stats, proposed_per_position=list(self.stats.proposed_per_position),
                                   accepted_per_position=list(self.stats.accepted_per_position))


def _describe(cost: StepCostModel) -> str:
    a, b, c, d = cost.coefficients
    return (f"{a * 1e3:.2f} ms + {b * 1e3:.3f} ms/token + {c * 1e3:.3f} ms/multi-token sequence + {d * 1e3:.2f} ms "
            "when more than one token")


def build_speculator(engine) -> Speculator:
    """The Speculator of `engine` for its `config.speculative` (the draft artifact is loaded here).

    In a tensor-parallel engine the proposer runs on rank 0 alone, beside the
    scheduler and the sampler that use its tokens: a draft small enough to pay
    gains nothing from being split (each of its k sequential steps would wait
    on collectives), and a replica on every rank would compute the same tokens
    for nobody. The verification step is an ordinary step of every rank.
    """
    config: SpeculativeConfig = engine.config.speculative
    if engine.pipeline is not None and engine.pipeline.depth > 1:
        # Batches in flight through the stages would verify proposals made before the previous batch's tokens.
        raise OctavoError("speculative decoding is not available with pipeline_parallel_size > 1 (it runs with "
                          "tensor parallelism, or with pipeline_depth 1)")
    if config.method == "ngram":
        proposer: Proposer = NgramProposer(config.ngram_min, config.ngram_max)
    else:
        draft = load_artifact(config.draft_path)
        check_same_tokenizer(engine.artifact, draft)
        num_blocks = draft_num_blocks(engine.block_manager.num_blocks, engine.block_manager.block_size,
                                      draft.kv_layout["block_size"], engine.config.max_num_seqs, config.num_tokens)
        proposer = DraftProposer(draft, engine.backend, engine.device, num_blocks,
                                 engine.config.max_num_batched_tokens, engine.config.seed)
    logger.info("speculative decoding: %s, up to %d tokens per step (%s)", config.method, config.num_tokens,
                "adaptive" if config.adaptive else "fixed")
    return Speculator(engine, config, proposer)
