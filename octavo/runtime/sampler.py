"""Batched next-token sampling with vLLM's semantics (penalties, temperature, top-k/top-p/min-p, seeds).

One call samples one token for each of N sequences from logits ``[N, V_graph]``. Only the first
``vocab_size`` columns are real tokens; padded columns are dropped before anything else, so they are
never sampled and never reported. All arithmetic is float32 whatever the logits' dtype.

Processing order (as vLLM):

1. log probabilities are taken from the RAW logits (``log_softmax`` over the real vocabulary);
2. ``logit_bias`` is added;
3. while ``len(output) < min_tokens``, EOS ids (unless ``ignore_eos``) and ``stop_token_ids`` are set
   to -inf;
4. repetition penalty (tokens present in the prompt or the output): ``logit / p`` if ``logit > 0``
   else ``logit * p``;
5. frequency and presence penalties over output tokens only:
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``;
6. structured output: the tokens a row's grammar does not allow next (``banned``, bool [N, V],
   computed by ``octavo.runtime.structured``) are set to -inf, one masked fill for the batch. A
   row that min_tokens' bans and the grammar together leave without any token (the grammar wants
   to stop) keeps the grammar's tokens alone;
7. greedy rows (temperature < 1e-5) take the argmax of these logits; random rows divide by the
   temperature, keep the ``top_k`` highest (exactly k, ties broken arbitrarily), keep the smallest
   set of highest-probability tokens whose cumulative probability reaches ``top_p`` (at least one),
   drop tokens whose probability is below ``min_p`` times the highest probability, and sample.

Sampling uses the exponential race: ``argmax(probs / E)`` with ``E`` i.i.d. Exp(1) noise picks token
``i`` with probability ``probs[i] / sum(probs)``, so the whole batch samples in one vectorized op.
A row with its own ``torch.Generator`` (a seeded request) draws its ``vocab_size`` noise values from
that generator, so its tokens do not depend on the other rows or its position in the batch; the
other rows share the sampler's generator seeded with ``seed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from octavo.codegen.cpu_backend.build import loaded_cpu_kernels
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.structured.masks import mask_banned_tokens

PROMPT_LOGPROBS_CHUNK_ROWS = 1024
"""Prompt positions processed at once by Sampler.prompt_logprobs (bounds the float32 [rows, V] copy)."""


@dataclass
class SamplingRow:
    """One sequence to sample a token for."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: Sequence[int]  # read only (the live output of the sequence)
    generator: torch.Generator | None  # set when params.seed is not None; kept by the engine per request


@dataclass
class SamplerOutput:
    """Result of one Sampler call over N rows.

    ``token_ids`` int64 [N]: the chosen tokens. ``sampled_logprobs`` float32 [N]:
    ``log_softmax(raw logits)[row, chosen token]``. ``sampled_ranks`` int64 [N]: 1 + the number of
    tokens with a strictly higher raw logprob. ``top_logprobs`` float32 [N, K] / ``top_token_ids``
    int64 [N, K]: the K highest raw logprobs, descending, K = the largest ``params.logprobs`` over the
    rows (both None when no row asks for logprobs; rows asking for fewer use the first columns).
    """

    token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor
    sampled_ranks: torch.Tensor
    top_logprobs: torch.Tensor | None
    top_token_ids: torch.Tensor | None


@dataclass
class SamplingDistributions:
    """What ``Sampler.distributions`` returns for N rows: ``greedy_token_ids`` int64 [N] (the argmax of
    each row's processed logits) and ``probs`` float32 [N, V], the processed sampling distributions,
    each summing to 1 (a greedy row's is a point mass on its argmax); None when every row is greedy."""

    greedy_token_ids: torch.Tensor
    probs: torch.Tensor | None


@dataclass
class PromptLogprobs:
    """Log probabilities of the prompt's tokens, for positions 1..P-1 of a P-token prompt (piece).

    Row ``j`` describes ``token_ids[j] = prompt_token_ids[j + 1]`` as predicted by logits row ``j``.
    ``logprobs`` float32 [P-1]: its raw log probability; ``ranks`` int64 [P-1]: its rank (1 = most
    likely); ``top_logprobs`` float32 [P-1, num_top] / ``top_token_ids`` int64 [P-1, num_top]: the
    ``num_top`` most likely tokens at that position, descending.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_logprobs: torch.Tensor
    top_token_ids: torch.Tensor


class Sampler:
    """Samples next tokens for a batch of sequences; see the module docstring for the semantics."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], seed: int = 0) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size)
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    # ----- public entry points -----

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 logprob_rows: Sequence[int] | None = None, banned: torch.Tensor | None = None) -> SamplerOutput:
        """Sample one token per row from ``logits`` [N, V_graph >= vocab_size] (any float dtype).

        ``logprob_rows`` (default: all rows) lists the rows whose logprobs are wanted: only those
        pay for a full-vocabulary log_softmax. The other rows get NaN in ``sampled_logprobs``, 0 in
        ``sampled_ranks`` and in the top columns NaN values and token id -1; their tokens are the same.
        ``banned`` (bool [N, vocab_size]) are tokens structured output forbids; logprobs stay those of
        the raw logits.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows "
                f"and vocab size {self.vocab_size}"
            )
        # In the graph's dtype: greedy rows take the argmax of these values as they are (widening to float32 is
        # exact and keeps their order); whatever computes on them widens them first.
        raw_logits = logits[:, : self.vocab_size]
        processed = self._apply_bias_and_min_tokens(raw_logits, rows)
        processed = self._apply_penalties(processed, rows)
        processed = self._apply_grammar(processed, raw_logits, banned, rows)
        token_ids = self._choose_tokens(processed, rows)
        return self._logprobs(raw_logits, rows, token_ids, logprob_rows)

    def _logprobs(self, raw_logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor,
                  logprob_rows: Sequence[int] | None) -> SamplerOutput:
        """The SamplerOutput of `token_ids`: logprobs, ranks and top logprobs of the `logprob_rows`."""
        max_logprobs = max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)
        num_top = None if max_logprobs is None else min(max_logprobs, self.vocab_size)
        if logprob_rows is None or len(logprob_rows) == len(rows):
            raw_logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
            sampled_logprobs, ranks = _logprobs_and_ranks(raw_logprobs, token_ids)
            top_logprobs = top_token_ids = None
            if num_top is not None:
                top_logprobs, top_token_ids = raw_logprobs.topk(num_top, dim=-1)
            return SamplerOutput(token_ids, sampled_logprobs, ranks, top_logprobs, top_token_ids)
        device = raw_logits.device
        count = len(rows)
        sampled_logprobs = torch.full((count,), float("nan"), device=device)
        ranks = torch.zeros(count, dtype=torch.int64, device=device)
        top_logprobs = top_token_ids = None
        if num_top is not None:
            top_logprobs = torch.full((count, num_top), float("nan"), device=device)
            top_token_ids = torch.full((count, num_top), -1, dtype=torch.int64, device=device)
        if len(logprob_rows):
            index = _int64(list(logprob_rows), device)
            raw_logprobs = torch.log_softmax(raw_logits[index].float(), dim=-1)
            sampled_logprobs[index], ranks[index] = _logprobs_and_ranks(raw_logprobs, token_ids[index])
            if num_top is not None:
                top_logprobs[index], top_token_ids[index] = raw_logprobs.topk(num_top, dim=-1)
        return SamplerOutput(token_ids, sampled_logprobs, ranks, top_logprobs, top_token_ids)

    def score(self, raw_logprobs: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The SamplerOutput of chosen ``token_ids`` [N] given each row's ``raw_logprobs`` [N, V]."""
        max_logprobs = max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)
        sampled_logprobs, ranks = _logprobs_and_ranks(raw_logprobs, token_ids)
        top_logprobs = top_token_ids = None
        if max_logprobs is not None:
            top_logprobs, top_token_ids = raw_logprobs.topk(min(max_logprobs, self.vocab_size), dim=-1)
        return SamplerOutput(token_ids, sampled_logprobs, ranks, top_logprobs, top_token_ids)

    def distributions(self, logits: torch.Tensor, rows: list[SamplingRow],
                      banned: torch.Tensor | None = None) -> SamplingDistributions:
        """The distribution each row's next token is drawn from, without drawing it.

        Same processing as ``__call__`` (so the probabilities are those ``__call__`` samples from,
        ``banned`` tokens included):
        ``probs[i]`` is normalized; a greedy row's is a point mass on ``greedy_token_ids[i]``, the
        argmax of its processed logits, which ``__call__`` would choose. Speculative decoding
        verifies proposals against these.
        """
        processed = self._apply_bias_and_min_tokens(logits[:, : self.vocab_size].float().clone(), rows)
        processed = self._apply_penalties(processed, rows)
        processed = self._apply_grammar(processed, logits[:, : self.vocab_size], banned, rows)
        greedy_token_ids = row_argmax(processed)
        random_rows = [index for index, row in enumerate(rows) if not row.params.is_greedy]
        if not random_rows:
            return SamplingDistributions(greedy_token_ids, None)
        probs = torch.zeros_like(processed).scatter_(1, greedy_token_ids.unsqueeze(1), 1.0)
        random_index = _int64(random_rows, logits.device)
        random_probs = self._random_probs(processed[random_index], [rows[i].params for i in random_rows])
        probs[random_index] = random_probs / random_probs.sum(dim=-1, keepdim=True)
        return SamplingDistributions(greedy_token_ids, probs)

    def score_logits(self, logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """``score`` of chosen ``token_ids`` [N] given each row's raw ``logits`` [N, V_graph]."""
        return self.score(torch.log_softmax(logits[:, : self.vocab_size].float(), dim=-1), token_ids, rows)

    def exponential_noise(self, generator: torch.Generator | None, num_rows: int,
                          device: torch.device) -> torch.Tensor:
        """Exp(1) noise [num_rows, vocab_size] as ``__call__`` draws it for rows with this generator
        (None: the sampler's shared one); a row drawn alone equals one sampled row of ``__call__``."""
        return self._exponential_noise([generator] * num_rows, device)

    def uniform(self, generator: torch.Generator | None, device: torch.device) -> float:
        """One U[0, 1) draw from ``generator`` (None: the sampler's shared generator)."""
        generator = generator if generator is not None else self._shared_generator(device)
        return float(torch.rand(1, generator=generator, device=generator.device))

    def prompt_logprobs(
        self, logits: torch.Tensor, prompt_token_ids: Sequence[int], num_top: int
    ) -> PromptLogprobs:
        """Log probabilities of ``prompt_token_ids[1:]``, logits row ``j`` predicting token ``j + 1``.

        ``logits`` [M, V_graph] are the model's outputs at the positions of ``prompt_token_ids``
        (M >= P - 1; rows beyond P - 1 are ignored). For chunked prefill, pass the chunk's logits
        and the chunk's tokens plus the token after it. The first token of the whole prompt has no
        log probability (nothing predicts it), as in vLLM. Values come from the raw logits.
        """
        target_ids = list(prompt_token_ids[1:])
        if logits.dim() != 2 or logits.shape[0] < len(target_ids) or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} cannot score {len(target_ids)} prompt tokens"
            )
        num_top = min(num_top, self.vocab_size)
        targets = torch.tensor(target_ids, dtype=torch.int64, device=logits.device)
        pieces: list[tuple[torch.Tensor, ...]] = []
        for start in range(0, len(target_ids), PROMPT_LOGPROBS_CHUNK_ROWS):
            stop = min(start + PROMPT_LOGPROBS_CHUNK_ROWS, len(target_ids))
            logprobs = torch.log_softmax(logits[start:stop, : self.vocab_size].float(), dim=-1)
            chosen, ranks = _logprobs_and_ranks(logprobs, targets[start:stop])
            top_values, top_ids = logprobs.topk(num_top, dim=-1)
            pieces.append((chosen, ranks, top_values, top_ids))
        if not pieces:  # a one-token prompt (piece): nothing to score
            no_values = torch.empty((0, num_top), dtype=torch.float32, device=logits.device)
            pieces.append((no_values[:, 0], targets, no_values, targets.view(0, num_top)))
        chosen, ranks, top_values, top_ids = (torch.cat(parts) for parts in zip(*pieces, strict=True))
        return PromptLogprobs(targets, chosen, ranks, top_values, top_ids)

    # ----- logit processing -----

    def _apply_bias_and_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """`logits` with logit_bias added and min_tokens bans applied: a float32 copy when any row has one."""
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        for index, row in enumerate(rows):
            for token_id, bias in (row.params.logit_bias or {}).items():
                if token_id < self.vocab_size:
                    bias_rows.append(index)
                    bias_tokens.append(token_id)
                    bias_values.append(bias)
            if len(row.output_token_ids) < row.params.min_tokens:
                banned = self._min_tokens_banned_ids(row.params)
                banned_rows.extend([index] * len(banned))
                banned_tokens.extend(banned)
        if not bias_rows and not banned_rows:
            return logits
        logits = logits.to(torch.float32, copy=True)
        device = logits.device
        if bias_rows:
            indices = (_int64(bias_rows, device), _int64(bias_tokens, device))
            values = torch.tensor(bias_values, dtype=torch.float32, device=device)
            logits.index_put_(indices, values, accumulate=True)
        if banned_rows:
            logits[_int64(banned_rows, device), _int64(banned_tokens, device)] = float("-inf")
        return logits

    def _min_tokens_banned_ids(self, params: SamplingParams) -> list[int]:
        banned = [t for t in params.stop_token_ids if t < self.vocab_size]
        if not params.ignore_eos:
            banned.extend(self.eos_token_ids)
        return banned

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        repetition = [row.params.repetition_penalty for row in rows]
        frequency = [row.params.frequency_penalty for row in rows]
        presence = [row.params.presence_penalty for row in rows]
        uses_repetition = any(p != 1.0 for p in repetition)
        if not uses_repetition and not any(frequency) and not any(presence):
            return logits
        device = logits.device
        logits = logits.float()
        output_counts = self._token_counts([row.output_token_ids for row in rows], device)
        if uses_repetition:
            prompt_counts = self._token_counts([row.prompt_token_ids for row in rows], device)
            present = (prompt_counts > 0) | (output_counts > 0)
            penalty = _float32(repetition, device).unsqueeze(1)
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(present, penalized, logits)
        frequency_column = _float32(frequency, device).unsqueeze(1)
        presence_column = _float32(presence, device).unsqueeze(1)
        return logits - frequency_column * output_counts - presence_column * (output_counts > 0).float()

    def _token_counts(self, token_lists: list[list[int]], device: torch.device) -> torch.Tensor:
        """Occurrences of each token id per row, float32 [N, vocab_size], by scatter_add over padding.

        Rows are padded with the id ``vocab_size``, which lands in an extra column that is dropped.
        """
        width = max(1, max(len(ids) for ids in token_lists))
        pad = self.vocab_size
        padded = torch.tensor(
            [list(ids) + [pad] * (width - len(ids)) for ids in token_lists], dtype=torch.int64, device=device
        ).clamp_(0, pad)
        counts = torch.zeros(len(token_lists), self.vocab_size + 1, dtype=torch.float32, device=device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
        return counts[:, : self.vocab_size]

    def _apply_grammar(self, logits: torch.Tensor, raw_logits: torch.Tensor, banned: torch.Tensor | None,
                       rows: list[SamplingRow]) -> torch.Tensor:
        """`logits` with the `banned` tokens at -inf (a new tensor); see step 6 of the module docstring."""
        if banned is None:
            return logits
        # Only min_tokens' bans set -inf before this step: rows under them are the only ones that can be emptied.
        emptiable = [index for index, row in enumerate(rows) if len(row.output_token_ids) < row.params.min_tokens]
        return mask_banned_tokens(logits, raw_logits, banned, emptiable)

    # ----- token choice -----

    def _choose_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        token_ids = row_argmax(logits)
        random_rows = [index for index, row in enumerate(rows) if not row.params.is_greedy]
        if not random_rows:
            return token_ids
        random_index = _int64(random_rows, logits.device)
        probs = self._random_probs(logits[random_index].float(), [rows[index].params for index in random_rows])
        noise = self._exponential_noise([rows[index].generator for index in random_rows], logits.device)
        token_ids[random_index] = row_argmax(probs / noise)
        return token_ids

    def _random_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p applied to processed logits: unnormalized after min-p."""
        device = logits.device
        temperature = _float32([p.temperature for p in params], device).unsqueeze(1)
        scaled = logits / temperature
        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size for p in params]
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        if any(k < self.vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = _apply_top_k_top_p(scaled, _int64(top_k, device), _float32(top_p, device))
        probs = torch.softmax(scaled, dim=-1)
        min_p = [p.min_p for p in params]
        if any(min_p):
            threshold = _float32(min_p, device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _exponential_noise(
        self, generators: list[torch.Generator | None], device: torch.device
    ) -> torch.Tensor:
        """Exp(1) noise [len(generators), vocab_size]; a row with a generator draws from it alone."""
        noise = torch.empty(len(generators), self.vocab_size, dtype=torch.float32, device=device)
        shared_rows = [index for index, generator in enumerate(generators) if generator is None]
        if shared_rows:
            shared = torch.empty(len(shared_rows), self.vocab_size, dtype=torch.float32, device=device)
            noise[_int64(shared_rows, device)] = shared.exponential_(generator=self._shared_generator(device))
        # A loop over seeded rows is unavoidable: each draws from its own generator.
        for index, generator in enumerate(generators):
            if generator is not None:
                row_noise = torch.empty(self.vocab_size, dtype=torch.float32, device=generator.device)
                noise[index] = row_noise.exponential_(generator=generator).to(device)
        # Exp(1) draws are positive in theory; guard against an exact 0 turning 0/0 into NaN.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return self._generators[device]


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of a 2-d tensor: by the CPU kernels' argmax_rows (the same indices, several
    times faster on vocabulary-sized rows) where the logits are on the CPU and those kernels are loaded."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[0] and loaded_cpu_kernels() is not None:
        return torch.ops.octavo_cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf all but the ``top_k[i]`` highest logits of row i, then all but the smallest set of
    highest-probability survivors whose cumulative probability reaches ``top_p[i]`` (one sort)."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    positions = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(positions >= top_k.unsqueeze(1), float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # A token is kept while the mass strictly before it is below top_p, so the first is always kept.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _logprobs_and_ranks(logprobs: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    return chosen.squeeze(1), ranks


def _int64(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _float32(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
