"""Beam search over the engine, as vLLM's LLM.beam_search defines it, with beams sharing KV blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from octavo.errors import OctavoError, RequestError
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.sequence import Sequence, SequenceStatus
from octavo.runtime.structured.spec import StructuredOutputs


@dataclass(frozen=True)
class BeamSearchParams:
    """`structured`: every beam follows this constraint (its banned tokens never become candidates)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "structured", StructuredOutputs.of(self.structured))
        if self.beam_width < 1:
            raise RequestError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    """One hypothesis: `tokens` are prompt + generated ids; `cum_logprob` sums the generated tokens' logprobs."""

    tokens: list[int]
    cum_logprob: float
    text: str = ""
    finished_with_eos: bool = False


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_ids: set[int],
                      length_penalty: float) -> float:
    """vLLM's ranking: cum_logprob / len ** length_penalty, len counting the prompt but not a final EOS."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length ** length_penalty)


@dataclass(eq=False)
class _Beam:
    seq: Sequence
    cum_logprob: float


@dataclass(eq=False)
class _Instance:
    prompt_len: int
    beams: list[_Beam]
    completed: list[BeamSearchSequence] = field(default_factory=list)
    row_of: dict[int, torch.Tensor] = field(default_factory=dict)  # id(beam seq) -> logprobs row


def beam_search(engine, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """For each prompt, `max_tokens` rounds (fewer if the beams reach max_model_len): every live
    beam proposes its 2 * beam_width most likely next tokens (raw log-softmax); candidates ending in
    EOS (unless ignore_eos) become completed hypotheses, the best `beam_width` others (by
    beam_search_score) become the next beams. At the end the best `beam_width` of completed + live
    beams are returned, best first.

    A new beam is a fork of its parent: it shares the parent's KV blocks (copy-on-write for the
    partially filled last block) and the parent's blocks are released when it is dropped.

    With `params.structured`, tokens a beam's grammar does not allow next are not candidates, and a
    stop token the grammar took completes the hypothesis even with ignore_eos (nothing may follow it).
    """
    if engine.has_unfinished_requests():
        raise OctavoError("beam_search needs an idle engine: finish or abort the running requests first")
    eos = set(engine.eos_token_ids)
    instances = [_start(engine, index, prompt, params.structured) for index, prompt in enumerate(prompts)]
    for _ in range(params.max_tokens):
        growing = [instance for instance in instances if _still_growing(engine, instance)]
        if not growing:
            break
        _run_until_scored(engine, growing)
        for instance in growing:
            _advance(engine, instance, params, eos)
    outputs = []
    for instance in instances:
        live = [BeamSearchSequence(list(beam.seq.token_ids), beam.cum_logprob) for beam in instance.beams]
        for beam in instance.beams:
            engine.scheduler.finish(beam.seq, SequenceStatus.FINISHED_LENGTH)
        ranked = sorted(instance.completed + live, reverse=True,
                        key=lambda s: beam_search_score(s.tokens, s.cum_logprob, eos, params.length_penalty))
        best = ranked[:params.beam_width]
        for hypothesis in best:
            hypothesis.text = engine.tokenizer.decode(hypothesis.tokens[instance.prompt_len:], skip_special_tokens=True)
        outputs.append(BeamSearchOutput(best))
    return outputs


def _still_growing(engine, instance: _Instance) -> bool:
    """Whether the instance's beams (all of one length) may take another token under max_model_len.

    Beams that reached max_model_len stop there, as live hypotheses; their blocks are freed now.
    """
    if not instance.beams:
        return False
    if len(instance.beams[0].seq.token_ids) < engine.max_model_len:
        return True
    for beam in instance.beams:
        engine.scheduler.finish(beam.seq, SequenceStatus.FINISHED_LENGTH)
    return False


def _start(engine, index: int, prompt: list[int], structured: StructuredOutputs | None) -> _Instance:
    _, token_ids = engine._tokenize(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len, ignore_eos=True)
    engine._validate(token_ids, params)
    grammar = engine.structured.start(structured) if structured is not None else None
    seq = Sequence(f"beam-{index}", 0, token_ids, params, detokenizer=None, grammar=grammar)
    engine.scheduler.add(seq)
    return _Instance(len(token_ids), [_Beam(seq, 0.0)])


def _run_until_scored(engine, instances: list[_Instance]) -> None:
    """Step the engine until every live beam has the logprobs of its next token."""
    waiting = {id(beam.seq) for instance in instances for beam in instance.beams}
    rows: dict[int, torch.Tensor] = {}
    while waiting - rows.keys():
        _park_scored_beams(engine, rows.keys())
        executed = engine.execute_step()
        if executed is None:
            raise RuntimeError("beam search stalled: the scheduler has nothing to run")
        schedule, inputs, logits = executed
        logprobs = torch.log_softmax(logits[:, :engine.vocab_size].float(), dim=-1)
        if engine.step_mask is not None:  # beams under a grammar: their banned tokens are no candidates
            sampled = list(range(len(inputs.sampled_rows)))
            banned = engine.step_mask.select(sampled, logprobs.device)
            if banned is not None:
                logprobs[:len(sampled)] = logprobs[:len(sampled)].masked_fill(banned, float("-inf"))
        for row, scheduled_index in enumerate(inputs.sampled_rows):
            rows[id(schedule.scheduled[scheduled_index].seq)] = logprobs[row]
    for instance in instances:
        instance.row_of = {id(beam.seq): rows[id(beam.seq)] for beam in instance.beams}


def _park_scored_beams(engine, scored) -> None:
    """Take scored beams that hold up the others out of the scheduler until their round ends.

    A scored beam has nothing to compute until the round ends. One that was preempted after it
    was scored need not be recomputed now; and when every running sequence is a scored beam
    while others wait for blocks or a slot, those would wait forever. Such beams are finished
    (their full blocks stay in the prefix cache); their children start as new sequences.
    """
    scheduler = engine.scheduler
    for seq in scheduler.waiting + scheduler.swapped:
        if id(seq) in scored:
            scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
    if (scheduler.waiting or scheduler.swapped) and not any(seq.num_uncomputed_tokens for seq in scheduler.running):
        for seq in list(scheduler.running):
            scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)


def _advance(engine, instance: _Instance, params: BeamSearchParams, eos: set[int]) -> None:
    candidates: list[tuple[float, _Beam, int]] = []
    for beam in instance.beams:
        values, tokens = instance.row_of[id(beam.seq)].topk(2 * params.beam_width)
        for logprob, token in zip(values.tolist(), tokens.tolist(), strict=True):
            if logprob == float("-inf"):
                break  # the grammar allows fewer tokens than were asked for
            if token in eos and (not params.ignore_eos or beam.seq.grammar is not None):
                instance.completed.append(BeamSearchSequence([*beam.seq.token_ids, token], beam.cum_logprob + logprob,
                                                             finished_with_eos=True))
            else:
                candidates.append((beam.cum_logprob + logprob, beam, token))
    candidates.sort(key=lambda c: beam_search_score([*c[1].seq.token_ids, c[2]], c[0], eos, params.length_penalty),
                    reverse=True)
    new_beams = []
    for cum_logprob, parent, token in candidates[:params.beam_width]:
        child = parent.seq.fork(len(new_beams), None)
        child.append_token(token)
        if child.grammar is not None:
            child.grammar.accept(token)
        if parent.seq.status is SequenceStatus.RUNNING:
            engine.block_manager.fork(parent.seq, child)
            engine.scheduler.add_running(child)
        else:  # the parent was preempted or parked after it was scored: its blocks are gone
            child.block_table, child.num_computed_tokens = [], 0
            child.status = SequenceStatus.WAITING
            engine.scheduler.add(child)
        new_beams.append(_Beam(child, cum_logprob))
    for beam in instance.beams:
        engine.scheduler.finish(beam.seq, SequenceStatus.FINISHED_STOPPED)
    instance.beams = new_beams
