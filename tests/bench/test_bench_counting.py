"""Token counting, timings and figures on fixed events (no server)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tokenmill.bench.counting import count_record, scale_split
from tokenmill.bench.prompts import fit_words, spread
from tokenmill.bench.records import CountingMethod, RawResponse, Status, StreamEvent
from tokenmill.bench.stats import distribution, meets_slos, percentile, summarize


def raw_with(events: list[StreamEvent], final: int | None = None,
             status: Status = Status.OK) -> RawResponse:
    raw = RawResponse(index=0, max_tokens=100, prompt_tokens_local=7, events=events,
                      final_completion_tokens=final, status=status, end_s=1.0)
    return raw


def test_continuous_usage_counts_deltas_including_empty_text_and_k_token_chunks():
    events = [
        StreamEvent(0.10, 0, "", 0),  # chat role chunk: no token
        StreamEvent(0.20, 0, "Hel", 2),  # first chunk carries 2 tokens
        StreamEvent(0.30, 0, "", 3),  # a token whose text is still empty
        StreamEvent(0.60, 0, " world!", 6),  # 3 tokens after a 0.3 s gap
    ]
    record = count_record(raw_with(events), None)
    assert record.counting_method is CountingMethod.CONTINUOUS_USAGE
    assert record.output_tokens == 6
    assert record.chunks == [(0.20, 2), (0.30, 1), (0.60, 3)]
    assert record.ttft_s == pytest.approx(0.20)
    # the first chunk's 2 tokens give no sample; then 1 x 0.1, then 3 x 0.1
    assert record.itl_s == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert record.tpot_s == pytest.approx((0.60 - 0.20) / 5)
    assert record.prompt_tokens == 7  # no usage prompt_tokens: the client's count


def test_usage_deltas_are_per_choice():
    events = [StreamEvent(0.1, 0, "a", 1), StreamEvent(0.1, 1, "b", 1),
              StreamEvent(0.2, 1, "c", 2), StreamEvent(0.3, 0, "d e", 3)]
    record = count_record(raw_with(events), None)
    assert [k for _, k in record.chunks] == [1, 1, 1, 2]
    assert record.output_tokens == 5


def test_final_usage_gives_the_total_and_chunks_the_split():
    events = [StreamEvent(0.1, 0, "ab", None), StreamEvent(0.2, 0, "", None),
              StreamEvent(0.4, 0, "cd", None)]
    record = count_record(raw_with(events, final=9), None)
    assert record.counting_method is CountingMethod.FINAL_USAGE
    assert record.output_tokens == 9
    assert record.chunks == [(0.1, 5), (0.4, 4)]  # empty text gets none; ties go first
    assert record.itl_s == pytest.approx([0.3 / 4] * 4)
    assert record.tpot_s == pytest.approx(0.3 / 8)


def test_scale_split_keeps_proportions_and_the_total():
    assert scale_split([1, 1, 1, 1, 1], 9) == [2, 2, 2, 2, 1]
    assert scale_split([1, 0, 3], 8) == [2, 0, 6]
    assert scale_split([0, 0], 5) == [0, 0]
    assert scale_split([1, 1, 1], 2) == [1, 1, 0]


def test_tokenizer_then_chunks_fallback():
    events = [StreamEvent(0.1, 0, " a b", None), StreamEvent(0.3, 0, " c", None)]
    words = lambda text: len(text.split())  # noqa: E731
    by_tokenizer = count_record(raw_with(events), words)
    assert by_tokenizer.counting_method is CountingMethod.TOKENIZER
    assert (by_tokenizer.output_tokens, by_tokenizer.chunks) == (3, [(0.1, 2), (0.3, 1)])
    by_chunks = count_record(raw_with(events), None)
    assert by_chunks.counting_method is CountingMethod.CHUNKS
    assert (by_chunks.output_tokens, by_chunks.itl_s) == (2, [pytest.approx(0.2)])


def test_request_without_tokens_has_no_ttft_or_tpot():
    record = count_record(raw_with([], status=Status.FAILED), None)
    assert (record.output_tokens, record.ttft_s, record.tpot_s, record.itl_s) == (0, None,
                                                                                 None, [])


def test_percentiles_match_numpy_linear_interpolation():
    rng = random.Random(3)
    values = sorted(rng.random() for _ in range(37))
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    dist = distribution([0.001, 0.002, 0.003, 0.004])  # seconds in, ms out
    assert (dist.count, dist.mean, dist.p50) == (4, pytest.approx(2.5), pytest.approx(2.5))


def test_goodput_counts_ok_requests_meeting_every_slo():
    fast = count_record(raw_with([StreamEvent(0.1, 0, "a", 1), StreamEvent(0.2, 0, "b", 2)]),
                        None)
    slow = count_record(raw_with([StreamEvent(0.9, 0, "a", 1), StreamEvent(0.95, 0, "b", 2)]),
                        None)
    one_token = count_record(raw_with([StreamEvent(0.1, 0, "a", 1)]), None)
    assert meets_slos(fast, {"ttft": 500, "tpot": 200})
    assert not meets_slos(slow, {"ttft": 500})
    assert meets_slos(one_token, {"tpot": 1})  # no TPOT: nothing to violate
    summary = summarize([fast, slow, one_token], 2.0, {"ttft": 500})
    assert summary.goodput == pytest.approx(1.0)  # 2 of 3 requests in 2 s
    assert summary.counting_method == "continuous_usage"


def test_spread_stays_in_range_and_fit_words_hits_the_target():
    rng = random.Random(0)
    lengths = [spread(rng, 100, 0.25) for _ in range(500)]
    assert min(lengths) >= 75 and max(lengths) <= 125 and len(set(lengths)) > 30

    async def two_per_word_plus_bos(text: str) -> int:
        return 2 * len(text.split()) + 1

    import asyncio

    text, count = asyncio.run(fit_words(["w"] * 300, 41, two_per_word_plus_bos))
    assert (len(text.split()), count) == (20, 41)
    text, count = asyncio.run(fit_words(["w"] * 300, 42, two_per_word_plus_bos))
    assert count == 41  # 42 is unreachable: the closest, preferring shorter
