"""An engine failure after streaming began reaches the client as an error event with the
usage so far, then [DONE]; the server then goes on serving."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
import uvicorn
from server_process import free_port

from tokenmill.config import EngineConfig
from tokenmill.frontend.async_engine import AsyncEngine
from tokenmill.frontend.builder import build_engine
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.app import build_app
from tokenmill.server.serving import ServerOptions


class FailingExecutor:
    """Runs the real model runner, but raises once on its ``fail_at``-th step."""

    def __init__(self, runner, fail_at: int) -> None:
        self.runner, self.fail_at, self.calls = runner, fail_at, 0

    def execute(self, scheduler_output):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("device lost")
        return self.runner.execute(scheduler_output)


@pytest.fixture
def failing_server(tiny_model):
    engine = build_engine(EngineConfig(model=tiny_model, dtype="float32", num_kv_blocks=256))
    engine.core.executor = FailingExecutor(engine.core.executor, fail_at=5)
    metrics = PrometheusMetrics("tiny")
    async_engine = AsyncEngine(engine.core, engine.tokenizer, [metrics], [metrics])
    app = build_app(async_engine, engine.processor, metrics, ServerOptions("tiny"),
                    engine.max_model_len)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    engine_thread = threading.Thread(target=async_engine.run, daemon=True)
    engine_thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(timeout=10)
    engine_thread.join(timeout=10)


def test_error_mid_stream_is_an_event_with_usage(failing_server) -> None:
    base, engine = failing_server
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
    engine.core.check_integrity()
    metrics = httpx.get(base + "/metrics").text
    assert re.search(r'tokenmill_request_success_total\{finished_reason="error".*\} 1\.0', metrics)
