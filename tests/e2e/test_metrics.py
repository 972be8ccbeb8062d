"""/metrics through the real server: counters equal ground truth, gauges are fresh, the
tokens-waiting gauges and admission control behave as documented."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_process import ServerProcess

BLOCK = 16


def completion(base_url: str, prompt, max_tokens: int, **extra) -> httpx.Response:
    return httpx.post(base_url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
        **extra})


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_counters_and_histograms_match_ground_truth(tiny_server) -> None:
    before = tiny_server.wait_idle()
    prompts = [[5 + i] * (3 + 4 * i) for i in range(5)]  # distinct, 3..19 tokens
    max_tokens = [2, 5, 7, 11, 13]
    for prompt, n in zip(prompts, max_tokens, strict=True):
        assert completion(tiny_server.base_url, prompt, n).json()["usage"]["completion_tokens"] == n
    after = tiny_server.wait_idle()
    assert delta(after, before, "tokenmill_prompt_tokens_total") == sum(map(len, prompts))
    assert delta(after, before, "tokenmill_generation_tokens_total") == sum(max_tokens)
    assert delta(after, before, "tokenmill_request_success_total{finished_reason=length}") == 5
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_params_n"):
        assert delta(after, before, f"tokenmill_{hist}_count") == 5, hist
    assert delta(after, before, "tokenmill_request_prompt_tokens_sum") == sum(map(len, prompts))
    assert delta(after, before, "tokenmill_request_generation_tokens_sum") == sum(max_tokens)
    assert delta(after, before, "tokenmill_inter_token_latency_seconds_count") == sum(
        n - 1 for n in max_tokens)
    assert delta(after, before, "tokenmill_request_time_per_output_token_seconds_count") == 5
    assert delta(after, before, "tokenmill_iteration_tokens_sum") == sum(map(len, prompts)) + sum(
        n - 1 for n in max_tokens)


def test_max_tokens_histogram_counts_only_requests_that_set_it(tiny_server) -> None:
    """The server resolves a chat request's unset ``max_tokens`` to the room left in the
    context; the histogram sees only the values requests carried."""
    before = tiny_server.wait_idle()
    assert completion(tiny_server.base_url, [5, 6, 7], 9).status_code == 200
    unset = httpx.post(tiny_server.base_url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0})
    assert unset.status_code == 200
    after = tiny_server.wait_idle()
    assert delta(after, before, "tokenmill_request_params_n_count") == 2
    assert delta(after, before, "tokenmill_request_params_max_tokens_count") == 1
    assert delta(after, before, "tokenmill_request_params_max_tokens_sum") == 9


def test_vllm_names_mirror_tokenmill_names(tiny_server) -> None:
    m = tiny_server.wait_idle()
    pairs = [("vllm:num_requests_running", "tokenmill_num_requests_running"),
             ("vllm:kv_cache_usage_perc", "tokenmill_kv_cache_usage_ratio"),
             ("vllm:generation_tokens_total", "tokenmill_generation_tokens_total"),
             ("vllm:time_to_first_token_seconds_count",
              "tokenmill_time_to_first_token_seconds_count")]
    for vllm_name, own_name in pairs:
        assert m[vllm_name] == m[own_name]


@pytest.fixture(scope="module")
def queue_server():
    """The embedded SmolLM2 (slow enough to hold a queue), one request at a time, capped queue."""
    server = ServerProcess(None, "--max-model-len", "1024", "--max-num-seqs", "1",
                           "--max-num-queued-requests", "4", "--max-num-queued-tokens", "200",
                           "--dtype", "bfloat16")
    yield server
    server.stop()


def _wait_for(server: ServerProcess, name: str, value: float, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m[name] == value:
            return m
        assert time.monotonic() < deadline, f"{name} stayed {m[name]}, expected {value}"
        time.sleep(0.02)


def test_tokens_waiting_and_admission_control(queue_server) -> None:
    base = queue_server.base_url
    shared = list(range(1000, 1040))  # 40 tokens: 2 full blocks once cached
    assert completion(base, shared, 1).status_code == 200
    blocker_done = threading.Event()
    blocker = threading.Thread(target=lambda: (completion(base, [7] * 10, 400),
                                               blocker_done.set()))
    blocker.start()
    _wait_for(queue_server, "tokenmill_num_requests_running", 1)
    results: dict[str, httpx.Response] = {}

    def submit(name: str, prompt: list[int]) -> None:
        thread = threading.Thread(target=lambda: results.__setitem__(
            name, completion(base, prompt, 3)))
        thread.start()
        threads.append(thread)

    threads: list[threading.Thread] = []
    submit("shared-a", shared + list(range(2000, 2010)))  # 50 tokens, 32 expected cached
    submit("shared-b", shared + list(range(3000, 3010)))  # 50 tokens, 32 expected cached
    submit("unique", list(range(4000, 4030)))  # 30 tokens
    _wait_for(queue_server, "tokenmill_num_requests_waiting", 3)
    too_many_tokens = completion(base, list(range(5000, 5080)), 3)  # 130 + 80 > 200
    assert too_many_tokens.status_code == 503
    assert too_many_tokens.json()["error"]["code"] == "max_num_queued_tokens"
    submit("short", list(range(6000, 6020)))  # 20 tokens: 4 waiting, 150 tokens
    m = _wait_for(queue_server, "tokenmill_num_requests_waiting", 4)
    assert m["tokenmill_num_tokens_waiting_raw"] == 150
    assert m["tokenmill_num_tokens_waiting"] == 150 - 2 * 2 * BLOCK
    too_many_requests = completion(base, [9, 9, 9], 3)
    assert too_many_requests.status_code == 503
    assert too_many_requests.json()["error"]["code"] == "max_num_queued_requests"
    m = queue_server.metrics()
    assert m["tokenmill_admission_rejections_total{reason=max_num_queued_tokens}"] == 1
    assert m["tokenmill_admission_rejections_total{reason=max_num_queued_requests}"] == 1
    assert not blocker_done.is_set(), "the blocker finished too early for this test"
    blocker.join()
    for thread in threads:
        thread.join()
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
               for r in results.values()), results
    m = queue_server.wait_idle()
    assert m["tokenmill_num_tokens_waiting"] == 0 and m["tokenmill_num_tokens_waiting_raw"] == 0


def test_gauges_fall_to_zero_when_every_request_is_cancelled(queue_server) -> None:
    """One running and four waiting requests, all cancelled: every gauge reads 0 at once."""
    streams = []
    for i in range(5):
        ctx = httpx.stream("POST", queue_server.base_url + "/v1/completions", timeout=30, json={
            "prompt": f"cancel me {i}", "max_tokens": 200, "ignore_eos": True, "stream": True})
        response = ctx.__enter__()
        streams.append((ctx, response))
    m = _wait_for(queue_server, "tokenmill_num_requests_waiting", 4)
    assert m["tokenmill_num_requests_running"] == 1 and m["tokenmill_num_tokens_waiting_raw"] > 0
    for ctx, _ in streams:
        ctx.__exit__(None, None, None)
    start = time.monotonic()
    m = queue_server.wait_idle(timeout=5)
    assert time.monotonic() - start < 5
    assert m["tokenmill_kv_cache_usage_ratio"] == 0 and m["tokenmill_num_tokens_waiting"] == 0
