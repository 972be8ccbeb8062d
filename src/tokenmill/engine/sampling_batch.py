"""One engine step's sampling settings, turned into tensors once on the host.

``SamplingBatch.build`` reads each row's ``SamplingParams`` (plus its prompt/output
tokens for penalties and seeds, and its banned ids) and leaves None every setting no
row uses, so the sampler skips that work. Row i of every tensor is row i of the logits.

``grammar_bitmask`` computes the allowed-token bitmasks of the rows of requests with a
structured output (from their grammars, ``tokenmill.structured``), for ``build``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.core.types import ScheduledRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.matcher import bitmask_width, fill_bitmasks

_SEED_MASK = (1 << 63) - 1


def step_seed(seed: int, position: int) -> int:
    """Seed of the noise for the token a request samples at output ``position``."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) & _SEED_MASK


@dataclass(slots=True)
class PenaltySettings:
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
    penalties: PenaltySettings | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (row index, token id) pairs
    # logit_bias: (row index, token id) pairs and each pair's bias (float32)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    num_logprobs: tuple[int | None, ...]
    logprob_rows: torch.Tensor | None  # [L] rows that asked for logprobs
    logprob_row_list: tuple[int, ...]
    max_num_logprobs: int
    grammar_rows: torch.Tensor | None = None  # [G] rows with a structured output
    grammar_bitmask: torch.Tensor | None = None  # [G, ceil(V / 32)] int32: allowed tokens

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab_size: int,
              device: torch.device | str,
              prompt_token_ids: Sequence[Sequence[int]] | None = None,
              output_token_ids: Sequence[Sequence[int]] | None = None,
              banned_token_ids: Sequence[Collection[int]] | None = None,
              grammar: tuple[Sequence[int], np.ndarray] | None = None) -> SamplingBatch:
        """Settings for rows ``0..len(params)-1``, in the order of the logits' rows.

        ``output_token_ids[i]`` are the tokens row i's request output before the one
        sampled now: needed for penalties and seeds (a speculative row at draft j passes
        the output plus drafts 0..j-1). ``prompt_token_ids`` are needed for repetition
        penalties; ``banned_token_ids[i]`` are ids row i may not sample this step
        (EOS/stop ids before ``min_tokens``). Ids at or beyond ``vocab_size`` are ignored.
        ``grammar`` is ``grammar_bitmask``'s (rows, bitmasks), or None. A row's
        ``logit_bias`` comes with its params (the input processor has checked its ids).
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
            bias=_build_bias(params, vocab_size, device),
            num_logprobs=tuple(p.logprobs for p in params),
            logprob_rows=(torch.tensor(logprob_rows, device=device) if logprob_rows else None),
            logprob_row_list=tuple(logprob_rows),
            max_num_logprobs=max((params[i].logprobs or 0 for i in logprob_rows), default=0),
            grammar_rows=(torch.tensor(grammar[0], device=device) if grammar else None),
            grammar_bitmask=(torch.from_numpy(grammar[1]).to(device) if grammar else None),
        )


def grammar_bitmask(items: Sequence[ScheduledRequest],
                    vocab_size: int) -> tuple[list[int], np.ndarray] | None:
    """(rows, bitmasks) of the sampled rows of requests with a grammar, rows laid out as
    ``spec_decode.verify_rows`` lays them out (1 + k per request with k drafts; row j sees
    drafts 1..j as output); bitmask i, over ``vocab_size`` tokens, is rows[i]'s. None
    when no request has a grammar."""
    entries = []
    rows: list[int] = []
    row = 0
    for item in items:
        num_rows = 1 + len(item.draft_token_ids)
        if item.grammar is not None:
            item.grammar.sync(item.output_token_ids)
            entries.append((item.grammar, len(rows), item.draft_token_ids))
            rows.extend(range(row, row + num_rows))
        row += num_rows
    if not entries:
        return None
    bitmask = np.zeros((len(rows), bitmask_width(vocab_size)), dtype=np.int32)
    fill_bitmasks(entries, bitmask)
    return rows, bitmask


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
                     device: torch.device | str) -> PenaltySettings | None:
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0
            or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not rows:
        return None
    assert prompt_token_ids is not None and output_token_ids is not None, \
        "penalties need the rows' prompt and output tokens"
    sel = [params[i] for i in rows]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    return PenaltySettings(
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


def _build_bias(params: Sequence[SamplingParams], vocab_size: int,
                device: torch.device | str,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    triples = [(row, t, b) for row, p in enumerate(params)
               for t, b in (p.logit_bias or {}).items() if 0 <= t < vocab_size]
    if not triples:
        return None
    rows, ids, biases = zip(*triples, strict=True)
    return (torch.tensor(rows, device=device), torch.tensor(ids, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))
