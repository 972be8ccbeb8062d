"""SIGTERM drains the server: new requests get 503 with Retry-After and /health fails;
requests in flight finish within --shutdown-timeout; the rest are aborted, each still
sent its finish and its usage; then the process exits cleanly."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from server_process import ServerProcess


@pytest.mark.slow
def test_sigterm_drains_then_aborts_with_usage() -> None:
    # the real model, so that the long request cannot finish within the drain
    server = ServerProcess(None, "--max-model-len", "2048", "--shutdown-timeout", "10")
    try:
        url = server.base_url + "/v1/completions"
        events: list[dict] = []
        first_chunk = threading.Event()
        results: dict[str, httpx.Response] = {}

        def long_stream() -> None:
            with httpx.stream("POST", url, timeout=60, json={
                    "prompt": "A long story", "max_tokens": 1500, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        first_chunk.set()
                    elif line == "data: [DONE]":
                        events.append({"done": True})

        def short_request() -> None:
            results["short"] = httpx.post(url, timeout=60, json={
                "prompt": "A short one", "max_tokens": 4, "ignore_eos": True})

        threads = [threading.Thread(target=long_stream)]
        threads[0].start()
        assert first_chunk.wait(30)
        threads.append(threading.Thread(target=short_request))
        threads[1].start()
        deadline = time.monotonic() + 10
        while server.metrics()["tokenmill_num_requests_running"] < 2:
            assert time.monotonic() < deadline, "the short request never started"
            time.sleep(0.01)
        server.process.send_signal(signal.SIGTERM)

        deadline = time.monotonic() + 5
        while True:  # admission stops at once
            refused = httpx.post(url, timeout=10, json={"prompt": "late", "max_tokens": 1})
            if refused.status_code == 503 or time.monotonic() > deadline:
                break
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "shutting_down"
        assert int(refused.headers["retry-after"]) >= 1
        assert httpx.get(server.base_url + "/health").status_code == 503

        for thread in threads:
            thread.join(timeout=60)
        short = results["short"]
        assert short.status_code == 200
        assert short.json()["choices"][0]["finish_reason"] == "length"
        assert short.json()["usage"]["completion_tokens"] == 4

        assert events[-1] == {"done": True}
        usage = events[-2]["usage"]
        choices = [e["choices"][0] for e in events[:-2]]
        assert choices[-1]["finish_reason"] == "abort"
        received = sum(1 for c in choices if c["logprobs"] is None and c["finish_reason"] is None)
        assert 0 < usage["completion_tokens"] < 1500
        assert received <= usage["completion_tokens"] <= received + 1
        assert server.process.wait(timeout=30) == 0
        log = server.log()
        assert "aborting 1 request(s)" in log and "Traceback" not in log
    finally:
        server.stop()
