"""A failed model step fails only that step's requests: a stream gets an error event with
the usage so far, then [DONE]; requests outside the step carry on; the server goes on
serving. After repeated consecutive failures /health answers 503."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest
import uvicorn
from server_process import free_port

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.inproc import InprocClient
from tokenmill.frontend.async_client import AsyncEngineClient
from tokenmill.frontend.processor import InputProcessor
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.app import build_app
from tokenmill.tokenizer.tokenizer import load_tokenizer


class FailingExecutor:
    """Runs the real model runner, but raises on its ``fail_at``-th step, and on every
    step while ``always`` is set."""

    def __init__(self, runner, fail_at: int = 0) -> None:
        self.runner, self.fail_at, self.calls, self.always = runner, fail_at, 0, False
        self.batches: list[set[str]] = []  # the requests of each step

    def execute(self, scheduler_output):
        self.calls += 1
        self.batches.append({r.req_id for r in scheduler_output.requests})
        if self.always or self.calls == self.fail_at:
            raise RuntimeError("device lost")
        return self.runner.execute(scheduler_output)


@pytest.fixture
def failing_server(tiny_model):
    yield from _serve(tiny_model, fail_at=5)


@pytest.fixture
def one_at_a_time_server(tiny_model):
    yield from _serve(tiny_model, fail_at=5, max_num_seqs=1)


def _serve(tiny_model: str, fail_at: int, **config):
    client = InprocClient(EngineConfig(model=tiny_model, dtype="float32", num_kv_blocks=256,
                                       **config))
    client.core.executor = FailingExecutor(client.core.executor, fail_at=fail_at)
    metrics = PrometheusMetrics("tiny")
    tokenizer = load_tokenizer(tiny_model)
    # the step loop turns on the receiver's thread (``engine.run``), not in a process
    engine = AsyncEngineClient(client, tokenizer, [metrics], [metrics])
    app = build_app(engine, InputProcessor(tokenizer, client.info), metrics,
                    ServerConfig(served_model_name="tiny"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    engine_thread = threading.Thread(target=engine.run, daemon=True)
    engine_thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", client
    server.should_exit = True
    thread.join(timeout=10)
    engine_thread.join(timeout=10)


def test_error_mid_stream_is_an_event_with_usage(failing_server) -> None:
    base, client = failing_server
    events = []
    with httpx.stream("POST", base + "/v1/completions", timeout=30, json={
            "prompt": "fail soon", "max_tokens": 20, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    error_event = json.loads(events[-2])
    assert "device lost" in error_event["error"]["message"]
    tokens_before = [json.loads(e)["usage"]["completion_tokens"] for e in events[:-2]]
    assert tokens_before == list(range(1, len(tokens_before) + 1)) and tokens_before
    assert error_event["usage"]["completion_tokens"] == tokens_before[-1]
    after = httpx.post(base + "/v1/completions", timeout=30, json={
        "prompt": "still here", "max_tokens": 3, "ignore_eos": True})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
    client.core.check_integrity()
    metrics = httpx.get(base + "/metrics").text
    assert re.search(r'tokenmill_request_success_total\{finished_reason="error".*\} 1\.0', metrics)


def test_only_the_failed_steps_requests_fail(one_at_a_time_server) -> None:
    """One request runs at a time: the step that fails holds the first, not the second,
    which then completes."""
    base, client = one_at_a_time_server

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            first = asyncio.create_task(client.post("/v1/completions", json={
                "prompt": "fails", "max_tokens": 20, "ignore_eos": True}))
            await asyncio.sleep(0.05)
            second = await client.post("/v1/completions", json={
                "prompt": "survives", "max_tokens": 8, "ignore_eos": True})
            return await first, second

    first, second = asyncio.run(main())
    assert first.status_code == 500 and "device lost" in first.json()["error"]["message"]
    assert second.status_code == 200, second.text
    assert second.json()["usage"]["completion_tokens"] == 8
    failed_step = client.core.executor.batches[4]
    assert len(failed_step) == 1  # the second request was waiting, not in the failed step
    client.core.check_integrity()
    assert client.core.kv.pool.num_used_blocks == 0


def test_health_fails_after_repeated_consecutive_failures(failing_server) -> None:
    base, client = failing_server
    client.core.executor.fail_at, client.core.executor.always = 0, True
    for attempt in range(3):
        assert httpx.get(base + "/health").status_code == 200, attempt
        r = httpx.post(base + "/v1/completions", timeout=30, json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error"
    assert httpx.get(base + "/health").status_code == 503
    client.core.executor.always = False
    r = httpx.post(base + "/v1/completions", timeout=30, json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200
    assert httpx.get(base + "/health").status_code == 200
    client.core.check_integrity()
