"""Turn a ``RawResponse`` into a ``RequestRecord``: tokens per chunk, then timings.

Counting method, first that applies (per request):

1. ``continuous_usage``: every received chunk carried usage. Chunk tokens are the
   difference of cumulative ``completion_tokens`` from the previous chunk of the same
   choice. Exact, including k-token chunks and tokens whose text is "".
2. ``final_usage``: no per-chunk usage, but a usage chunk without choices (or the
   usage of an error event) gave the total. The total is exact; the split over chunks
   (used for ITL and TTFT) is estimated as in 3 or 4, then scaled to sum to the total
   (largest remainders), so 20 chunks of a 40-token answer count 2 tokens each.
3. ``tokenizer``: a local tokenizer counts each chunk's text (the split) and the whole
   received text (the total).
4. ``chunks``: one token per chunk carrying non-empty text.

Timings, from the chunks carrying at least one token (times since the request was
sent)::

    tokens   k0=2      k1=1     k2=3
    time  ---t0--------t1-------t2-------->
    TTFT = t0             ITL samples: [t1-t0] + 3 x [(t2-t1)/3]
    TPOT = (t2 - t0) / (total - 1)

The first chunk's tokens arrive together with the first token, so they give no ITL
sample; every later chunk of k tokens after a gap g gives k samples of g/k.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.bench.records import (
    CountingMethod,
    RawResponse,
    RequestRecord,
    Status,
    StreamEvent,
)

CountFn = Callable[[str], int]  # text -> number of tokens (no special tokens)


def count_record(raw: RawResponse, count_text: CountFn | None) -> RequestRecord:
    """Count ``raw``'s tokens (local tokenizer ``count_text`` if given) and time them."""
    assert raw.status is not None and raw.end_s is not None, "count a request once it ended"
    method, split, total = count_tokens(raw, count_text)
    chunks = [(ev.ts_s, k) for ev, k in zip(raw.events, split, strict=True) if k > 0]
    itl: list[float] = []
    for (prev_ts, _), (ts, k) in zip(chunks, chunks[1:], strict=False):
        itl.extend([(ts - prev_ts) / k] * k)
    ttft = chunks[0][0] if chunks else None
    tpot = (chunks[-1][0] - chunks[0][0]) / (total - 1) if chunks and total > 1 else None
    prompt_tokens = (raw.usage_prompt_tokens if raw.usage_prompt_tokens is not None
                     else raw.prompt_tokens_local)
    return RequestRecord(
        index=raw.index, status=raw.status, error=raw.error, start_s=raw.start_s,
        e2e_s=raw.end_s, prompt_tokens=prompt_tokens, max_tokens=raw.max_tokens,
        output_tokens=total, counting_method=method, ttft_s=ttft, tpot_s=tpot, itl_s=itl,
        chunks=chunks,
    )


def count_tokens(raw: RawResponse,
                 count_text: CountFn | None) -> tuple[CountingMethod, list[int], int]:
    """Return (method, tokens per event of ``raw.events``, total output tokens)."""
    events = raw.events
    if events and all(ev.completion_tokens is not None for ev in events):
        split = usage_deltas(events)
        return CountingMethod.CONTINUOUS_USAGE, split, sum(split)
    if count_text is not None:
        method = CountingMethod.TOKENIZER
        split = [count_text(ev.text) if ev.text else 0 for ev in events]
        total = sum(count_text(text) for text in _text_per_choice(events))
    else:
        method = CountingMethod.CHUNKS
        split = [1 if ev.text else 0 for ev in events]
        total = sum(split)
    if raw.final_completion_tokens is not None:
        total = raw.final_completion_tokens
        return CountingMethod.FINAL_USAGE, scale_split(split, total), total
    return method, split, total


def scale_split(split: list[int], total: int) -> list[int]:
    """``split`` scaled to sum to ``total`` by largest remainders (ties: earlier chunk).

    An all-zero split stays zero: there is no chunk to put tokens on.
    """
    estimated = sum(split)
    if estimated == 0:
        return split
    shares = [k * total / estimated for k in split]
    scaled = [int(share) for share in shares]
    by_remainder = sorted(range(len(split)), key=lambda i: (scaled[i] - shares[i], i))
    for i in by_remainder[: total - sum(scaled)]:
        scaled[i] += 1
    return scaled


def usage_deltas(events: list[StreamEvent]) -> list[int]:
    """Tokens per event: cumulative usage minus the previous value for the same choice.

    A decrease (a server bug) counts as 0 rather than as negative tokens.
    """
    last: dict[int, int] = {}
    split = []
    for ev in events:
        assert ev.completion_tokens is not None
        split.append(max(0, ev.completion_tokens - last.get(ev.choice, 0)))
        last[ev.choice] = max(ev.completion_tokens, last.get(ev.choice, 0))
    return split


def _text_per_choice(events: list[StreamEvent]) -> list[str]:
    texts: dict[int, list[str]] = {}
    for ev in events:
        texts.setdefault(ev.choice, []).append(ev.text)
    return ["".join(parts) for parts in texts.values()]


def method_is_informative(record: RequestRecord) -> bool:
    """Whether ``record.counting_method`` reflects what the server sent.

    A request that failed before any output was counted by a fallback by default; it
    says nothing about the server and is left out of the run's overall method.
    """
    return record.status is Status.OK or record.output_tokens > 0
