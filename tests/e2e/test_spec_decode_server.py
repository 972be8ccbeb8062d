"""Speculative decoding through the real server: a chunk carries every token its step
committed, and usage, logprobs, ITL, the spec-decode counters, per-request metrics,
the log line and ``tokenmill bench`` all count them."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from openai import OpenAI
from server_process import ServerProcess

from tokenmill.bench import BenchConfig, run_benchmark
from tokenmill.bench.report import figures

PROMPT = [17, 45, 210, 33, 5, 17, 45, 210, 33, 5, 17, 45, 210]
MAX_TOKENS = 40
BENCH_WARMUP_TOKENS = 8


@pytest.fixture(scope="module")
def spec_server(tiny_model):
    server = ServerProcess(tiny_model, "--served-model-name", "tiny", "--max-model-len", "256",
                           "--metrics-vllm-names", "--speculative-ngram", "4", "--ngram-min", "1",
                           "--log-stats-interval", "0.5")
    yield server
    server.stop()


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_multi_token_chunks_are_counted_everywhere(spec_server) -> None:
    client = OpenAI(base_url=spec_server.base_url + "/v1", api_key="unused", max_retries=0)
    before = spec_server.wait_idle()
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1,
        stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True,
                        "include_metrics": True})
    per_chunk, metrics, previous = [], None, 0
    for chunk in stream:
        if not chunk.choices:
            metrics = chunk.model_extra.get("metrics") or metrics
            continue
        k = chunk.usage.completion_tokens - previous
        previous = chunk.usage.completion_tokens
        assert len(chunk.choices[0].logprobs.tokens) == k
        per_chunk.append(k)
        metrics = chunk.model_extra.get("metrics") or metrics
    after = spec_server.wait_idle()

    assert previous == sum(per_chunk) == MAX_TOKENS
    assert min(per_chunk) >= 1 and max(per_chunk) > 1
    (stats,) = metrics
    drafted, accepted = stats["num_draft_tokens"], stats["num_accepted_tokens"]
    assert 0 < accepted <= drafted
    assert stats["draft_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert len(per_chunk) == MAX_TOKENS - accepted  # each step: accepted drafts + 1
    assert stats["num_generation_tokens"] == MAX_TOKENS

    assert delta(after, before, "tokenmill_generation_tokens_total") == MAX_TOKENS
    assert delta(after, before, "tokenmill_spec_decode_num_draft_tokens_total") == drafted
    assert delta(after, before, "tokenmill_spec_decode_num_accepted_tokens_total") == accepted
    drafts = delta(after, before, "tokenmill_spec_decode_num_drafts_total")
    assert 0 < drafts <= len(per_chunk) - 1
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        own = after[f"tokenmill_spec_decode_{name}_total"]
        assert after[f"vllm:spec_decode_{name}_total"] == own
    # one ITL sample per token after the first step's, together spanning the decode time
    assert delta(after, before, "tokenmill_inter_token_latency_seconds_count") == MAX_TOKENS - 1
    assert delta(after, before, "tokenmill_inter_token_latency_seconds_sum") == pytest.approx(
        stats["decode_time"], rel=1e-6, abs=1e-9)
    deadline = time.monotonic() + 10  # the summary line comes within a second or two
    while not re.search(r"draft acceptance rate \d+\.\d%", spec_server.log()):
        assert time.monotonic() < deadline, spec_server.log()
        time.sleep(0.2)


def test_bench_reports_tokens_per_chunk(spec_server, tmp_path) -> None:
    dataset = tmp_path / "repeat.jsonl"
    dataset.write_text(json.dumps({"prompt": "The quick brown fox jumps over the lazy dog. " * 4})
                       + "\n")
    before = spec_server.wait_idle()
    config = BenchConfig(base_url=spec_server.base_url, dataset=str(dataset), output_len=32,
                         num_requests=4, concurrency=2, ignore_eos=True, temperature=0.0)
    result = asyncio.run(run_benchmark(config))
    after = spec_server.wait_idle()
    summary = result.summary
    assert summary.num_ok == 4 and summary.counting_method == "continuous_usage"
    assert delta(after, before, "tokenmill_generation_tokens_total") == (
        summary.total_output_tokens + BENCH_WARMUP_TOKENS)
    chunks = [k for record in result.requests for _, k in record.chunks]
    assert summary.mean_tokens_per_chunk == pytest.approx(sum(chunks) / len(chunks))
    assert summary.max_tokens_per_chunk == max(chunks) > 1
    labels = dict(figures(result.to_json()["summary"]))
    assert labels["tokens per chunk (max)"] == max(chunks)
