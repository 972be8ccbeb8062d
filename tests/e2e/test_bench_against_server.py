"""``tokenmill bench`` against the real server: its token counts equal the server's own."""

from __future__ import annotations

import asyncio

from tokenmill.bench import BenchConfig, run_benchmark
from tokenmill.bench.stream import Endpoint

WARMUP_TOKENS = 8


def test_bench_counts_equal_server_metrics(tiny_server) -> None:
    before = tiny_server.wait_idle()
    config = BenchConfig(base_url=tiny_server.base_url, input_len=16, output_len=8,
                         num_requests=8, concurrency=4, ignore_eos=True)
    result = asyncio.run(run_benchmark(config))
    after = tiny_server.wait_idle()
    summary = result.summary
    assert summary.num_ok == 8 and summary.num_failed == 0
    assert summary.counting_method == "continuous_usage"
    assert summary.total_output_tokens == 64
    generated = (after["tokenmill_generation_tokens_total"]
                 - before["tokenmill_generation_tokens_total"])
    assert generated == summary.total_output_tokens + WARMUP_TOKENS
    prompts = after["tokenmill_prompt_tokens_total"] - before["tokenmill_prompt_tokens_total"]
    assert 0 < prompts - summary.total_prompt_tokens <= 16 * 2  # the rest is the warm-up's


def test_bench_asks_for_logprobs_on_both_endpoints(tiny_server) -> None:
    """``--logprobs N``: each endpoint's form of the request is one the server accepts,
    and the tokens are still counted exactly."""
    for endpoint in ("completions", "chat"):
        config = BenchConfig(base_url=tiny_server.base_url, endpoint=endpoint, input_len=16,
                             output_len=8, num_requests=4, concurrency=2, ignore_eos=True,
                             logprobs=3)
        summary = asyncio.run(run_benchmark(config)).summary
        assert summary.num_ok == 4 and summary.num_failed == 0
        assert summary.total_output_tokens == 32
    payloads = [Endpoint("u", chat, "m", {}, False, None, logprobs=3).payload("p", 4)
                for chat in (False, True)]
    assert payloads[0]["logprobs"] == 3 and "top_logprobs" not in payloads[0]
    assert payloads[1]["logprobs"] is True and payloads[1]["top_logprobs"] == 3
