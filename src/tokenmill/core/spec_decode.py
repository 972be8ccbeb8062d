"""Speculative decoding with prompt-lookup (n-gram) drafts: propose, then verify.

Propose (the scheduler, on the host): for a request about to sample, find an earlier
occurrence of its last n tokens (n from ``ngram_max`` down to ``ngram_min``) in its
prompt + output, and draft the up to K tokens that followed it. No second model.

Verify (the model runner): the request computes its last token and its k drafts in one
forward pass, and the sampler samples one token at each of the 1 + k positions,
position j as if drafts 1..j were already output (penalties, min_tokens, seed
position)::

    token_ids:  last  d1  d2  d3            (k = 3 drafts)
    sampled:    t0    t1  t2  t3
    committed:  t0, then each t_j while t_{j-1} == d_j  (the accepted drafts + one token)

This is standard speculative rejection sampling for a draft that is a single token (a
point mass q on d): accept d with probability p(d), else sample from the residual
(p - q)+ / Z, which is p without d. Sampling t ~ p and accepting iff t == d does
exactly that: P(t == d) = p(d), and t given t != d follows p without d. So every
committed token follows the target distribution, greedy output is identical token for
token, and a seeded row, whose noise depends only on (seed, output position), samples
the same tokens with or without speculation.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from tokenmill.core.types import ScheduledRequest, TokenLogprob
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """Drafts by prompt lookup: the tokens that followed the longest earlier match of
    the sequence's last tokens."""

    num_speculative_tokens: int  # K
    min_n: int
    max_n: int

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> tuple[int, ...]:
        """Up to ``min(K, max_drafts)`` draft tokens to follow ``token_ids``; () if no match.

        Among earlier occurrences of the longest matching suffix (at most ``max_n``
        tokens, at least ``min_n``), the most recent one followed by a full draft wins;
        when none is, the earliest (which has the most tokens after it).
        """
        k = min(self.num_speculative_tokens, max_drafts)
        if k <= 0 or len(token_ids) <= self.min_n:
            return ()
        tokens = np.asarray(token_ids)
        length = len(tokens)
        # ends: where an earlier match of the last n tokens ends (never the suffix itself)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        n = 1
        while ends.size and n < self.max_n and n < length - 1:
            ends = ends[ends >= n]
            longer = ends[tokens[ends - n] == tokens[length - 1 - n]]
            if not longer.size:
                break
            ends, n = longer, n + 1
        if not ends.size or n < self.min_n:
            return ()
        full = ends[ends + k < length]
        start = int(full[-1] if full.size else ends[0]) + 1
        return tuple(tokens[start:start + k].tolist())


class _OutputWithDrafts(Sequence[int]):
    """A request's output followed by some of its drafts, without copying the output."""

    __slots__ = ("_output", "_drafts")

    def __init__(self, output: Sequence[int], drafts: Sequence[int]) -> None:
        self._output = output
        self._drafts = drafts

    def __len__(self) -> int:
        return len(self._output) + len(self._drafts)

    def __getitem__(self, index):  # type: ignore[override]
        return list(self)[index]

    def __iter__(self):
        yield from self._output
        yield from self._drafts


@dataclass(frozen=True, slots=True)
class VerifyRows:
    """Per-row sampling inputs of the sampled positions, 1 + k rows per request, in
    the order of ``ScheduledRequest``s (see ``SamplingBatch.build``)."""

    params: list[SamplingParams]
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]
    banned_token_ids: list[Collection[int]]


def verify_rows(items: Sequence[ScheduledRequest]) -> VerifyRows:
    """Row j of a request samples its output position ``len(output) + j``: it sees
    drafts 1..j as output, and its stop tokens are banned while below ``min_tokens``."""
    rows = VerifyRows([], [], [], [])
    for item in items:
        output, drafts = item.output_token_ids, item.draft_token_ids
        for j in range(1 + len(drafts)):
            rows.params.append(item.sampling_params)
            rows.prompt_token_ids.append(item.prompt_token_ids)
            rows.output_token_ids.append(
                _OutputWithDrafts(output, drafts[:j]) if j else output)
            below_min = len(output) + j < item.sampling_params.min_tokens
            rows.banned_token_ids.append(item.mask_stop_tokens if below_min else ())
    return rows


def accept_drafts(items: Sequence[ScheduledRequest], token_ids: Sequence[int],
                  logprobs: Sequence[TokenLogprob | None],
                  ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[TokenLogprob, ...]]]:
    """Per request, the tokens to commit (accepted drafts + one) and their logprobs.

    ``token_ids`` / ``logprobs`` hold one sampled row per position, laid out as
    ``verify_rows`` lays them out.
    """
    sampled: dict[str, tuple[int, ...]] = {}
    sampled_logprobs: dict[str, tuple[TokenLogprob, ...]] = {}
    row = 0
    for item in items:
        drafts = item.draft_token_ids
        n = 1
        while n <= len(drafts) and token_ids[row + n - 1] == drafts[n - 1]:
            n += 1
        sampled[item.req_id] = tuple(token_ids[row:row + n])
        if logprobs[row] is not None:
            sampled_logprobs[item.req_id] = tuple(logprobs[row:row + n])  # type: ignore[arg-type]
        row += 1 + len(drafts)
    return sampled, sampled_logprobs
