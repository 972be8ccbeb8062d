"""Whole runs through ``run_benchmark`` against the stand-in servers of ``bench_standin``."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from tokenmill.bench import BenchConfig, BenchSetupError, CountingMethod, Status, run_benchmark
from tokenmill.bench.loadgen import arrival_gaps


def run(base_url: str, **kwargs) -> object:
    kwargs = {"input_len": 12, "output_len": 9, "num_requests": 4, "concurrency": 2} | kwargs
    return asyncio.run(run_benchmark(BenchConfig(base_url=base_url, **kwargs)))


def check_chunk_arithmetic(record) -> None:
    """Every chunk after the first gives k samples of gap/k; TPOT spans first..last token."""
    samples = []
    for (prev_ts, _), (ts, k) in zip(record.chunks, record.chunks[1:], strict=False):
        samples.extend([(ts - prev_ts) / k] * k)
    assert record.itl_s == samples
    first_ts, last_ts = record.chunks[0][0], record.chunks[-1][0]
    assert record.tpot_s == pytest.approx((last_ts - first_ts) / (record.output_tokens - 1))


def test_continuous_usage_counts_exactly(standin):
    _, root = standin
    result = run(f"{root}/usage=continuous,k=1,delay=0.002", range_ratio=0.5, num_requests=6)
    assert result.summary.counting_method == "continuous_usage"
    assert result.info["prompt_length_method"] == "server /tokenize"
    for record in result.requests:
        assert record.status is Status.OK
        assert record.output_tokens == record.max_tokens  # the stand-in always fills max_tokens
        assert 6 <= record.prompt_tokens <= 18  # 12 +- 50 %, fitted exactly by /tokenize
        assert [k for _, k in record.chunks] == [1] * record.max_tokens
        check_chunk_arithmetic(record)
    assert result.summary.total_output_tokens == sum(r.max_tokens for r in result.requests)
    assert len({r.max_tokens for r in result.requests}) > 1  # range_ratio spreads outputs
    assert result.notes == []


def test_final_usage_only_gives_exact_totals(standin):
    _, root = standin
    result = run(f"{root}/usage=final,k=2")
    assert result.summary.counting_method == "final_usage"
    for record in result.requests:
        assert record.output_tokens == 9
        # the split is estimated (one per chunk), then scaled to the exact total
        assert [k for _, k in record.chunks] == [2, 2, 2, 2, 1]
        check_chunk_arithmetic(record)
    assert any("final_usage" in note for note in result.notes)


def test_no_usage_falls_back_to_the_tokenizer_then_to_chunks(standin, word_tokenizer):
    _, root = standin
    url = f"{root}/usage=none,k=3,tokenize=0"
    by_tokenizer = run(url, tokenizer=word_tokenizer)
    assert by_tokenizer.summary.counting_method == "tokenizer"
    assert by_tokenizer.info["prompt_length_method"] == "local tokenizer"
    assert [r.output_tokens for r in by_tokenizer.requests] == [9] * 4
    assert all([k for _, k in r.chunks] == [3, 3, 3] for r in by_tokenizer.requests)
    by_chunks = run(url)
    assert by_chunks.summary.counting_method == "chunks"
    assert [r.output_tokens for r in by_chunks.requests] == [3] * 4
    assert by_chunks.info["prompt_length_method"].startswith("words")
    assert any("approximate" in note for note in by_chunks.notes)


def test_k_token_chunks_give_k_itl_samples_of_gap_over_k(standin):
    _, root = standin
    result = run(f"{root}/usage=continuous,k=3,delay=0.03", output_len=10, concurrency=1,
                 num_requests=2)
    for record in result.requests:
        assert [k for _, k in record.chunks] == [3, 3, 3, 1]
        assert record.output_tokens == 10
        assert len(record.itl_s) == 10 - 3
        check_chunk_arithmetic(record)
        assert all(0.03 / 3 * 0.8 < s < 0.03 / 3 * 3 for s in record.itl_s[:6])
    assert result.summary.itl_ms.count == 2 * 7


def test_duration_run_cuts_requests_off_and_counts_their_tokens(standin, tmp_path):
    stand_in, root = standin
    dataset = tmp_path / "slow.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"slow {i}", "max_tokens": 1000}) + "\n"
                               for i in range(2)))
    # chunks come every 0.1 s; the deadline at 0.65 s falls far from any chunk
    result = run(f"{root}/usage=continuous,k=1,delay=0.1", dataset=str(dataset),
                 duration=0.65, num_requests=None)
    assert [r.status for r in result.requests] == [Status.CUT_OFF] * 2
    assert result.summary.num_cut_off == 2 and result.summary.num_ok == 0
    for record in result.requests:
        assert record.output_tokens == stand_in.sent[f"slow {record.index}"] == 6
        assert record.counting_method is CountingMethod.CONTINUOUS_USAGE
    assert result.summary.duration_s == pytest.approx(0.65, abs=0.05)
    assert result.summary.output_throughput == pytest.approx(12 / result.summary.duration_s)
    # cut-off requests give TTFT and ITL samples, but no TPOT or E2EL
    assert (result.summary.ttft_ms.count, result.summary.itl_ms.count) == (2, 2 * 5)
    assert (result.summary.tpot_ms.count, result.summary.e2el_ms.count) == (0, 0)
    # the client mostly waited for chunks: a small share of one core, measured, not absent
    assert 0 < result.summary.client_cpus < 0.5


@pytest.mark.parametrize("fail, error", [("error@4", "error event: stand-in failed mid-stream"),
                                         ("drop@4", "Response payload is not completed"),
                                         ("http500", "HTTP 500: stand-in refuses")])
def test_failures_keep_partial_tokens_and_their_error(standin, tmp_path, fail, error):
    _, root = standin
    dataset = tmp_path / "mixed.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": p}) for p in ("ok one", "fail two")))
    result = run(f"{root}/usage=continuous,fail={fail}", dataset=str(dataset))
    ok = [r for r in result.requests if r.index % 2 == 0]
    failed = [r for r in result.requests if r.index % 2 == 1]
    assert all(r.status is Status.OK and r.output_tokens == 9 for r in ok)
    for record in failed:
        assert record.status is Status.FAILED
        assert error in record.error
        assert record.output_tokens == (0 if fail == "http500" else 4)
    assert result.summary.num_failed == 2
    assert result.summary.total_output_tokens == 2 * 9 + sum(r.output_tokens for r in failed)
    assert result.summary.ttft_ms.count == 2  # failed requests give no latency samples


def test_rejected_continuous_usage_falls_back_at_warm_up(standin):
    _, root = standin
    result = run(f"{root}/reject_continuous=1")
    assert result.info["stream_options"] == {"include_usage": True}
    assert result.summary.counting_method == "final_usage"
    assert [r.output_tokens for r in result.requests] == [9] * 4


def test_chat_role_chunk_is_not_a_token(standin):
    _, root = standin
    result = run(f"{root}/usage=continuous,k=1,delay=0.02", endpoint="chat", num_requests=2,
                 concurrency=1)
    for record in result.requests:
        assert record.output_tokens == 9 and len(record.chunks) == 9
        assert record.ttft_s >= 0.02  # the role chunk came at once; the first token later
    assert any("chat" in note for note in result.notes)


def test_arrival_gaps_are_seeded_gamma_with_the_requested_mean_and_burstiness():
    for burstiness in (0.5, 1.0, 4.0):
        draw = arrival_gaps(10.0, burstiness, seed=1)
        gaps = [draw() for _ in range(20000)]
        again = arrival_gaps(10.0, burstiness, seed=1)
        assert [again() for _ in range(5)] == gaps[:5]
        mean = sum(gaps) / len(gaps)
        variance = sum((g - mean) ** 2 for g in gaps) / len(gaps)
        assert mean == pytest.approx(0.1, rel=0.05)
        # gamma(shape b, scale 1/(r b)): variance 1 / (r^2 b); lower b is burstier
        assert variance == pytest.approx(1 / (100 * burstiness), rel=0.1)
    assert arrival_gaps(math.inf, 1.0, seed=1)() == 0.0


def test_request_rate_sends_on_the_seeded_schedule(standin):
    _, root = standin
    result = run(f"{root}/k=3", request_rate=20.0, concurrency=None, num_requests=8, seed=5)
    draw = arrival_gaps(20.0, 1.0, seed=5)
    scheduled = [0.0]
    for _ in range(7):
        scheduled.append(scheduled[-1] + draw())
    for record, planned in zip(result.requests, scheduled, strict=True):
        assert planned - 0.002 <= record.start_s <= planned + 0.1


def test_concurrency_keeps_exactly_n_requests_in_flight(standin):
    stand_in, root = standin
    stand_in.max_active = 0
    result = run(f"{root}/k=1,delay=0.01", concurrency=3, num_requests=9)
    assert stand_in.max_active == 3
    assert result.summary.num_ok == 9


def test_warm_up_failure_is_a_setup_error(standin, tmp_path):
    _, root = standin
    dataset = tmp_path / "fail.jsonl"
    dataset.write_text(json.dumps({"prompt": "fail always"}) + "\n")
    with pytest.raises(BenchSetupError, match="warm-up request .* failed: HTTP 500"):
        run(f"{root}/fail=http500", dataset=str(dataset))
