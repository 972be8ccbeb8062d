"""Logits -> next token ids (and logprobs) for one engine step.

``SamplingBatch.build`` turns the per-row settings into a few tensors once per step;
``Sampler()(logits, batch)`` then runs batched tensor ops. Host syncs: the token ids;
the logprobs when asked for; top-p's check that its candidates hold top_p.

Per row, in this order (as vLLM does):

    logit_bias added to its ids                           (rows with one; what logprobs
                                                           report includes it)
    grammar's forbidden ids -> -inf                       (rows with a structured output:
                                                           grammar_mask.py)
    raw logprobs = log_softmax(logits)                    (what ``logprobs`` reports)
    banned ids (min_tokens not reached) -> -inf
    repetition penalty on prompt+output tokens; frequency/presence on output tokens
    greedy row: argmax                                    (temperature 0 or top_k 1)
    other rows: / temperature -> min-p -> top-k -> top-p -> sample

Sampling inverts the cumulative distribution: one uniform u per row, token = the first
i whose cumulative probability exceeds u * (total), which picks token i with
probability p_i (a token of probability 0 never: its cumulative sum equals its
predecessor's). One random number per row, not one per vocabulary entry: generating
those was most of a sampling step. A seeded row draws its u from a generator seeded
with ``step_seed(seed, position)`` (see sampling_batch.py), where position is the number
of tokens the request has output before this one. Its tokens therefore depend only on
its seed, its logits and its position: never on the other rows of the batch, and with
no generator state to keep across steps, preemptions or speculative drafts. Unseeded
rows draw from torch's default generator.

Logits may come in the model's dtype (bfloat16, say): an all-greedy batch takes the
argmax of them as they are (the native ``argmax_rows`` where the engine has the native
kernels; a conversion to float32 is exact, so the answer is the same), and with the native
``sample_rows`` a batch that uses nothing but temperatures samples them as they are (the
same inversion of the cumulative distribution at the same u, in one pass over each row);
everything else widens them to float32 first. Asking for logprobs does not change the
route a row's token takes: the raw logprobs are computed beside it, from logits the
sampler has not written into. Without the native kernels they are ``log_softmax`` into a
buffer before the token is chosen; with them, the native ``logprob_rows`` reads the logits
once the token is known (its rank needs it), which the routes above leave as they are
(the filtering route samples from a float32 copy then).

NOTE: the sampler writes into ``logits`` in place; callers pass a tensor they no longer need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.types import TokenLogprob
from tokenmill.engine.grammar_mask import apply_bitmask
from tokenmill.engine.sampling_batch import PenaltySettings, SamplingBatch
from tokenmill.kernels import NativeKernels

# Top-p first looks for its cut among this many most likely tokens, and sorts the whole
# vocabulary only for a row whose candidates hold less than its top_p.
_TOP_P_CANDIDATES = 1024
# Logprobs' top-k looks in blocks of this many ids (see _top_k).
_TOP_K_BLOCK = 256


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for rows that did not ask for logprobs


class Sampler:
    """Every setting arrives in the ``SamplingBatch``; the only state is one scratch
    generator per device, reseeded for each seeded row. ``kernels``: the engine's native
    kernels (their ``argmax_rows``, ``sample_rows`` and ``logprob_rows``), or None for
    PyTorch's ops."""

    def __init__(self, kernels: NativeKernels | None = None) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}
        self._kernels = kernels
        self._scratch: torch.Tensor | None = None  # _raw_logprobs' output, reused

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, "one row per request"
        if batch.bias is not None:  # only the biased (row, id) entries change
            rows, ids, biases = batch.bias
            logits.index_put_((rows, ids), biases.to(logits.dtype), accumulate=True)
        if batch.grammar_rows is not None:
            assert batch.grammar_bitmask is not None
            apply_bitmask(logits, batch.grammar_rows, batch.grammar_bitmask)
        # With the native kernels, logprob_rows reads ``logits`` once the tokens are known
        # (the rank needs them), so no route below may write into them; without, the raw
        # logprobs are taken now.
        native_logprobs = self._kernels is not None and batch.logprob_rows is not None
        raw_logprobs = None if native_logprobs else self._raw_logprobs(logits, batch)
        plain = batch.penalties is None and batch.banned is None
        if plain and batch.all_greedy:
            tokens = self._greedy(logits)
        elif (plain and self._kernels is not None and batch.min_p is None
                and batch.top_k is None and batch.top_p_rows is None):
            assert batch.temperature is not None, "built whenever a row samples"
            tokens = self._kernels.sample_rows(logits, batch.temperature.view(-1),
                                               self._uniforms(batch, logits.device).view(-1))
            if batch.greedy is not None:
                tokens = torch.where(batch.greedy, self._greedy(logits), tokens)
        else:  # writes into its float32 logits: a copy where logprob_rows reads them after
            tokens = self._filter_and_sample(logits.to(torch.float32, copy=native_logprobs),
                                             batch)
        token_ids = tokens.tolist()
        if native_logprobs:
            logprobs = self._native_logprobs(logits, token_ids, batch)
        else:
            logprobs = _gather_logprobs(raw_logprobs, token_ids, batch)
        return SamplerOutput(token_ids, logprobs)

    def _native_logprobs(self, logits: torch.Tensor, token_ids: list[int],
                         batch: SamplingBatch) -> list[TokenLogprob | None]:
        """The native ``logprob_rows`` over the rows that asked for logprobs, on ``logits``
        as the sampler received them (after the grammar's mask): what ``_raw_logprobs`` and
        ``_gather_logprobs`` answer within float32 rounding (its ranks and order counted on
        the logits, see logprob_rows.cpp), in one pass over each row."""
        assert self._kernels is not None and batch.logprob_rows is not None
        rows = batch.logprob_row_list
        if len(rows) < batch.num_rows:
            logits = logits[batch.logprob_rows]
        sampled = torch.tensor([token_ids[r] for r in rows], device=logits.device)
        values, top_ids, ranks = self._kernels.logprob_rows(logits, sampled,
                                                            batch.max_num_logprobs)
        return _token_logprobs(values, top_ids, ranks, token_ids, batch)

    def _raw_logprobs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
        """``log_softmax`` in float32 of the rows that asked for logprobs (None if none
        did), written into the sampler's scratch buffer, which every call reuses (a new
        tensor of 16 MiB a step, 16 rows of a 262k vocabulary, cost its page faults): valid
        until the next call. What the sampler then writes into ``logits`` does not reach
        it."""
        if batch.logprob_rows is None:
            return None
        if len(batch.logprob_row_list) < batch.num_rows:
            logits = logits[batch.logprob_rows]
        size = logits.numel()
        if (self._scratch is None or self._scratch.numel() < size
                or self._scratch.device != logits.device):
            self._scratch = torch.empty(size, dtype=torch.float32, device=logits.device)
        out = self._scratch[:size].view(logits.shape)
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32, out=out)

    def _filter_and_sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Tokens after the bans and penalties (written into ``logits``), then the filters."""
        if batch.banned is not None:
            logits[batch.banned] = float("-inf")
        if batch.penalties is not None:
            _apply_penalties(logits, batch.penalties)
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        return self._sample(logits, batch)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None:
            return self._kernels.argmax_rows(logits)
        return logits.float().argmax(-1)

    def _uniforms(self, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
        """``[B, 1]``: each sampling row's u in [0, 1), from its seed where it has one."""
        u = torch.empty(batch.num_rows, 1, device=device)
        if batch.any_unseeded:
            u.uniform_()
        for row, seed in batch.seeded:
            generator = self._generator(device)
            generator.manual_seed(seed)
            u[row].uniform_(generator=generator)
        return u

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1) if batch.greedy is not None else None
        assert batch.temperature is not None, "built whenever a row samples"
        logits.div_(batch.temperature)
        if batch.min_p is not None:
            probs = logits.softmax(dim=-1)
            logits.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * batch.min_p,
                                float("-inf"))
        if batch.top_k is not None:
            kth = logits.topk(batch.max_top_k, dim=-1).values.gather(1, batch.top_k)
            logits.masked_fill_((logits < kth) & ~batch.top_k_off, float("-inf"))
        if batch.top_p_rows is not None:
            assert batch.top_p is not None
            _apply_top_p(logits, batch.top_p_rows, batch.top_p)
        cdf = logits.softmax(dim=-1).cumsum_(dim=-1)
        u = self._uniforms(batch, cdf.device)
        # NOTE: the point stays below the total (u < 1, and rounding is capped), so some
        # entry lies above it; right=True skips the entries of probability 0 (equal to the
        # sum before them).
        total = cdf[:, -1:]
        point = torch.minimum(u.mul_(total), torch.nextafter(total, torch.zeros_like(total)))
        tokens = torch.searchsorted(cdf, point, right=True).squeeze(1)
        if greedy_tokens is not None:
            assert batch.greedy is not None
            tokens = torch.where(batch.greedy, greedy_tokens, tokens)
        return tokens


def _apply_penalties(logits: torch.Tensor, pen: PenaltySettings) -> None:
    """vLLM's penalties: logit / r (if > 0) or * r for tokens seen in prompt or output;
    minus frequency * count and presence * [count > 0] for output tokens."""
    vocab_size = logits.shape[1]
    rows = logits[pen.rows]

    def bins(ids: torch.Tensor) -> torch.Tensor:  # [R, V] counts; padding lands in bin V
        ids = ids.masked_fill((ids < 0) | (ids >= vocab_size), vocab_size)
        counts = torch.zeros(rows.shape[0], vocab_size + 1, device=logits.device)
        return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))[:, :-1]

    output_counts = bins(pen.output_ids)
    seen = (bins(pen.prompt_ids) > 0) | (output_counts > 0)
    scale = torch.where(seen, pen.repetition, 1.0)
    rows = torch.where(rows > 0, rows / scale, rows * scale)
    rows -= pen.frequency * output_counts + pen.presence * (output_counts > 0)
    logits[pen.rows] = rows


def _apply_top_p(logits: torch.Tensor, rows: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep, in each of ``rows``, the smallest set of most likely tokens whose probability
    reaches its top_p: a token goes when the tokens ranked above it already hold top_p.

    The cut is searched among the top ``_TOP_P_CANDIDATES`` tokens when they hold top_p
    in every row (the usual case), which avoids sorting the vocabulary.
    """
    sub = logits[rows]
    probs = sub.softmax(dim=-1)
    num_candidates = min(_TOP_P_CANDIDATES, sub.shape[1])
    ranked_probs, ranked_ids = probs.topk(num_candidates, dim=-1)
    if num_candidates < sub.shape[1] and not bool(
            (ranked_probs.sum(dim=-1, keepdim=True) >= top_p).all()):
        ranked_probs, ranked_ids = probs.sort(dim=-1, descending=True)
    mass_before = ranked_probs.cumsum(dim=-1) - ranked_probs
    keep = torch.zeros_like(sub, dtype=torch.bool).scatter_(1, ranked_ids, mass_before < top_p)
    logits[rows] = sub.masked_fill_(~keep, float("-inf"))


def _top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` largest values and their ids, largest first, ties to the lower id.

    Found by blocks of ``_TOP_K_BLOCK`` (``topk`` over a whole 262k vocabulary is most of a
    step's logprob cost): the ``k`` largest values lie in the ``k`` blocks whose maxima are
    largest, plus the last partial block; only those candidates are sorted. Blocks of equal
    maxima are taken in id order, so the tied values that make the cut are the lowest ids'."""
    rows, width = values.shape
    whole = width // _TOP_K_BLOCK * _TOP_K_BLOCK
    maxima = values[:, :whole].view(rows, -1, _TOP_K_BLOCK).amax(dim=-1)
    ranked = maxima.sort(dim=-1, descending=True, stable=True).indices
    blocks = ranked[:, :k].sort(dim=-1).values
    offsets = torch.arange(_TOP_K_BLOCK, device=values.device)
    ids = torch.cat([(blocks[:, :, None] * _TOP_K_BLOCK + offsets).view(rows, -1),
                     torch.arange(whole, width, device=values.device).expand(rows, -1)], dim=1)
    candidates, order = values.gather(1, ids).sort(dim=-1, descending=True, stable=True)
    return candidates[:, :k], ids.gather(1, order[:, :k])


def _gather_logprobs(raw_logprobs: torch.Tensor | None, token_ids: list[int],
                     batch: SamplingBatch) -> list[TokenLogprob | None]:
    """Sampled token's raw logprob and rank, and the top-n, by PyTorch's ops: the native
    ``logprob_rows``'s answers, but ranked and ordered on the rounded logprobs rather than
    the logits. Consumes ``raw_logprobs`` (the ranks are counted in place)."""
    if raw_logprobs is None:
        return [None] * batch.num_rows
    sampled = torch.tensor([token_ids[r] for r in batch.logprob_row_list],
                           device=raw_logprobs.device)
    sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))
    top_values, top_ids = _top_k(raw_logprobs, batch.max_num_logprobs)
    # lp - s > 0 exactly where lp > s (float subtraction of unequal numbers is never 0); in
    # place, summing 0.0/1.0: a third of the time of a sum of a new tensor of booleans
    ranks = raw_logprobs.sub_(sampled_logprobs).gt_(0).sum(dim=-1) + 1
    return _token_logprobs(torch.cat([sampled_logprobs, top_values], dim=1), top_ids, ranks,
                           token_ids, batch)


def _token_logprobs(values: torch.Tensor, top_ids: torch.Tensor, ranks: torch.Tensor,
                    token_ids: list[int], batch: SamplingBatch) -> list[TokenLogprob | None]:
    """Per row of ``batch.logprob_row_list``, in order: ``values [L, 1 + k]`` (the sampled
    token's logprob, then the top-k's), ``top_ids [L, k]`` and ``ranks [L]``, with
    k = ``batch.max_num_logprobs`` -> each row's ``TokenLogprob`` (its own top-n, the first
    n), fetched in one transfer; None for the rows that did not ask."""
    out: list[TokenLogprob | None] = [None] * batch.num_rows
    # Float32 holds every id and rank exactly (vocabularies are far below 2**24).
    packed = torch.cat([ranks.float().unsqueeze(1), values, top_ids.float()], dim=1).tolist()
    k = batch.max_num_logprobs
    for row, (rank, logprob, *top) in zip(batch.logprob_row_list, packed, strict=True):
        n = batch.num_logprobs[row]
        assert n is not None, "only rows that asked for logprobs are listed"
        out[row] = TokenLogprob(token_id=token_ids[row], logprob=logprob, rank=int(rank),
                                top=tuple(zip((int(i) for i in top[k:k + n]), top[:n],
                                              strict=True)))
    return out
