"""Logits -> next token ids (and logprobs) for one engine step.

``SamplingBatch.build`` turns the per-row settings into a few tensors once per step;
``Sampler()(logits, batch)`` then runs batched tensor ops, with two host syncs at most
(the token ids, and the logprobs when asked for).

Per row, in this order (as vLLM does):

    raw logprobs = log_softmax(logits)                    (what ``logprobs`` reports)
    banned ids (min_tokens not reached) -> -inf
    repetition penalty on prompt+output tokens; frequency/presence on output tokens
    greedy row: argmax                                    (temperature 0 or top_k 1)
    other rows: / temperature -> min-p -> top-k -> top-p -> sample

Sampling is an exponential race: token = argmax(p_i / q_i), q_i ~ Exp(1), which
picks token i with probability p_i. A seeded row draws its q from a generator seeded
with ``step_seed(seed, position)``, where position is the number of tokens the request
has output before this one. Its tokens therefore depend only on its seed, its logits
and its position: never on the other rows of the batch, and with no generator state to
keep across steps, preemptions or speculative drafts. Unseeded rows draw from torch's
default generator.

NOTE: the sampler writes into ``logits`` in place; callers pass a tensor they no longer need.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.core.types import TokenLogprob
from tokenmill.sampling_params import SamplingParams

# Top-p first looks for its cut among this many most likely tokens, and sorts the whole
# vocabulary only for a row whose candidates hold less than its top_p.
_TOP_P_CANDIDATES = 1024


_SEED_MASK = (1 << 63) - 1


def step_seed(seed: int, position: int) -> int:
    """Seed of the noise for the token a request samples at output ``position``."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & _SEED_MASK


@dataclass(slots=True)
class _Penalties:
    """Penalty settings of the rows that use any, with their tokens padded by -1."""

    rows: torch.Tensor  # [R] row index
    prompt_ids: torch.Tensor  # [R, Lp] (empty rows when repetition_penalty == 1)
    output_ids: torch.Tensor  # [R, Lo]
    repetition: torch.Tensor  # [R, 1]
    frequency: torch.Tensor  # [R, 1]
    presence: torch.Tensor  # [R, 1]


@dataclass(slots=True)
class SamplingBatch:
    """One step's sampling settings as tensors. Build with ``SamplingBatch.build``.

    Fields left None are features no row of this step uses, so their work is skipped.
    """

    num_rows: int
    all_greedy: bool
    greedy: torch.Tensor | None  # [B] bool, when some rows are greedy and some not
    temperature: torch.Tensor | None  # [B, 1]; 1.0 on greedy rows
    min_p: torch.Tensor | None  # [B, 1]
    top_k: torch.Tensor | None  # [B, 1] long, k - 1 clamped to max_top_k - 1
    top_k_off: torch.Tensor | None  # [B, 1] bool: rows without top-k
    max_top_k: int
    top_p_rows: torch.Tensor | None  # [P] sampling rows with top_p < 1
    top_p: torch.Tensor | None  # [P, 1]
    seeded: tuple[tuple[int, int], ...]  # (row, step_seed) of seeded sampling rows
    any_unseeded: bool  # a sampling row draws from the default generator
    penalties: _Penalties | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (row index, token id) pairs
    num_logprobs: tuple[int | None, ...]
    logprob_rows: torch.Tensor | None  # [L] rows that asked for logprobs
    logprob_row_list: tuple[int, ...]
    max_num_logprobs: int

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab_size: int,
              device: torch.device | str,
              prompt_token_ids: Sequence[Sequence[int]] | None = None,
              output_token_ids: Sequence[Sequence[int]] | None = None,
              banned_token_ids: Sequence[Collection[int]] | None = None) -> SamplingBatch:
        """Settings for rows ``0..len(params)-1``, in the order of the logits' rows.

        ``output_token_ids[i]`` are the tokens row i's request output before the one
        sampled now: needed for penalties and seeds (a speculative row at draft j passes
        the output plus drafts 0..j-1). ``prompt_token_ids`` are needed for repetition
        penalties; ``banned_token_ids[i]`` are ids row i may not sample this step
        (EOS/stop ids before ``min_tokens``). Ids at or beyond ``vocab_size`` are ignored.
        """
        n = len(params)
        greedy = [p.greedy for p in params]
        sampling_rows = [i for i in range(n) if not greedy[i]]
        seeded_rows = [i for i in sampling_rows if params[i].seed is not None]
        assert not seeded_rows or output_token_ids is not None, "seeds need output positions"
        seeded = tuple((i, step_seed(params[i].seed, len(output_token_ids[i])))
                       for i in seeded_rows)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(
            num_rows=n,
            all_greedy=not sampling_rows,
            greedy=(torch.tensor(greedy, device=device)
                    if sampling_rows and len(sampling_rows) < n else None),
            **_filter_settings(params, greedy, vocab_size, device),
            seeded=seeded, any_unseeded=len(seeded) < len(sampling_rows),
            penalties=_build_penalties(params, prompt_token_ids, output_token_ids, device),
            banned=_build_banned(banned_token_ids, vocab_size, device),
            num_logprobs=tuple(p.logprobs for p in params),
            logprob_rows=(torch.tensor(logprob_rows, device=device) if logprob_rows else None),
            logprob_row_list=tuple(logprob_rows),
            max_num_logprobs=max((params[i].logprobs or 0 for i in logprob_rows), default=0),
        )


def _filter_settings(params: Sequence[SamplingParams], greedy: list[bool], vocab_size: int,
                     device: torch.device | str) -> dict[str, Any]:
    """Temperature, min-p, top-k and top-p columns; None for what no sampling row uses."""
    settings: dict[str, Any] = dict(temperature=None, min_p=None, top_k=None, top_k_off=None,
                                    max_top_k=0, top_p_rows=None, top_p=None)
    sampling = [p for p, g in zip(params, greedy, strict=True) if not g]
    if not sampling:
        return settings

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

    settings["temperature"] = column(
        [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], torch.float32)
    if any(p.min_p > 0.0 for p in sampling):
        settings["min_p"] = column([p.min_p for p in params], torch.float32)
    ks = [0 if g else p.top_k for p, g in zip(params, greedy, strict=True)]
    max_top_k = min(max(ks), vocab_size)
    if max_top_k > 0:
        settings.update(
            max_top_k=max_top_k,
            top_k=column([min(k, max_top_k) - 1 if k else 0 for k in ks], torch.long),
            top_k_off=column([k == 0 for k in ks], torch.bool))
    top_p_rows = [i for i, (p, g) in enumerate(zip(params, greedy, strict=True))
                  if not g and p.top_p < 1.0]
    if top_p_rows:
        settings.update(top_p_rows=torch.tensor(top_p_rows, device=device),
                        top_p=column([params[i].top_p for i in top_p_rows], torch.float32))
    return settings


def _padded(rows: list[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [-1] * (width - len(r)) for r in rows],
                        dtype=torch.long, device=device).reshape(len(rows), width)


def _build_penalties(params: Sequence[SamplingParams],
                     prompt_token_ids: Sequence[Sequence[int]] | None,
                     output_token_ids: Sequence[Sequence[int]] | None,
                     device: torch.device | str) -> _Penalties | None:
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0
            or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not rows:
        return None
    assert prompt_token_ids is not None and output_token_ids is not None, \
        "penalties need the rows' prompt and output tokens"
    sel = [params[i] for i in rows]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return _Penalties(
        rows=torch.tensor(rows, device=device),
        prompt_ids=_padded([prompt_token_ids[i] if params[i].repetition_penalty != 1.0 else ()
                            for i in rows], device),
        output_ids=_padded([output_token_ids[i] for i in rows], device),
        repetition=column([p.repetition_penalty for p in sel]),
        frequency=column([p.frequency_penalty for p in sel]),
        presence=column([p.presence_penalty for p in sel]),
    )


def _build_banned(banned_token_ids: Sequence[Collection[int]] | None, vocab_size: int,
                  device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    pairs = [(row, t) for row, ids in enumerate(banned_token_ids or ())
             for t in ids if 0 <= t < vocab_size]
    if not pairs:
        return None
    rows, ids = zip(*pairs, strict=True)
    return torch.tensor(rows, device=device), torch.tensor(ids, device=device)


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for rows that did not ask for logprobs


class Sampler:
    """Every setting arrives in the ``SamplingBatch``; the only state is one scratch
    generator per device, reseeded for each seeded row."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, "one row per request"
        if (batch.all_greedy and batch.penalties is None and batch.banned is None
                and batch.logprob_rows is None):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * batch.num_rows)
        logits = logits.float()
        raw_logprobs = (torch.log_softmax(logits[batch.logprob_rows], dim=-1)
                        if batch.logprob_rows is not None else None)
        if batch.banned is not None:
            logits[batch.banned] = float("-inf")
        if batch.penalties is not None:
            _apply_penalties(logits, batch.penalties)
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, batch)
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, _gather_logprobs(raw_logprobs, token_ids, batch))

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
        probs = logits.softmax(dim=-1)
        u = torch.empty_like(probs)  # q = -log(u), u ~ U[0, 1): cheaper than exponential_()
        if batch.any_unseeded:
            u.uniform_()
        for row, seed in batch.seeded:
            generator = self._generator(u.device)
            generator.manual_seed(seed)
            u[row].uniform_(generator=generator)
        # NOTE: u < 1 keeps q > 0; u == 0 gives q = inf and p / q = 0, never NaN.
        tokens = probs.div_(u.log_().neg_()).argmax(dim=-1)
        if greedy_tokens is not None:
            assert batch.greedy is not None
            tokens = torch.where(batch.greedy, greedy_tokens, tokens)
        return tokens


def _apply_penalties(logits: torch.Tensor, pen: _Penalties) -> None:
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


def _gather_logprobs(raw_logprobs: torch.Tensor | None, token_ids: list[int],
                     batch: SamplingBatch) -> list[TokenLogprob | None]:
    """Sampled token's raw logprob and rank, and the top-n, fetched in one transfer."""
    out: list[TokenLogprob | None] = [None] * batch.num_rows
    if raw_logprobs is None:
        return out
    rows = batch.logprob_row_list
    sampled = torch.tensor([token_ids[r] for r in rows], device=raw_logprobs.device)
    sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1, keepdim=True) + 1
    top_values, top_ids = raw_logprobs.topk(batch.max_num_logprobs, dim=-1)
    # Float32 holds every id and rank exactly (vocabularies are far below 2**24).
    packed = torch.cat([sampled_logprobs, ranks.float(), top_values, top_ids.float()], dim=1)
    k = batch.max_num_logprobs
    for row, values in zip(rows, packed.tolist(), strict=True):
        n = batch.num_logprobs[row]
        assert n is not None, "only rows that asked for logprobs are listed"
        top = tuple(zip((int(i) for i in values[2 + k:2 + k + n]), values[2:2 + n], strict=True))
        out[row] = TokenLogprob(token_id=token_ids[row], logprob=values[0], rank=int(values[1]),
                                top=top)
    return out
