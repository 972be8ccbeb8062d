"""The page and the JSON endpoints behind its dashboard, through the real server: what
they report matches what happened, in flight and after; no request text without
--ui-show-text; the page loads nothing from elsewhere."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from server_process import ServerProcess

from tokenmill.server.ui import STATIC_DIR


def recent(base_url: str, limit: int = 10, **headers) -> dict:
    response = httpx.get(f"{base_url}/v1/requests/recent?limit={limit}", headers=headers,
                         timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def entry(base_url: str, request_id: str) -> dict:
    return next(e for e in recent(base_url, 50)["data"] if e["id"] == request_id)


def stream_completion(base_url: str, request_id: str, prompt: str, max_tokens: int):
    return httpx.stream("POST", base_url + "/v1/completions", timeout=60,
                        headers={"x-request-id": request_id}, json={
                            "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                            "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}})


@pytest.mark.parametrize("path", ["/", "/ui"])
def test_page_is_served_with_a_strict_content_security_policy(tiny_server, path) -> None:
    page = httpx.get(tiny_server.base_url + path)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assets = re.findall(r'<(?:script|link)[^>]* (?:src|href)="(/[^"]*)"', page.text)
    assert len(assets) == 2
    for asset in assets:
        assert asset.startswith("/ui/static/"), asset
        assert httpx.get(tiny_server.base_url + asset).status_code == 200


def test_static_files_load_nothing_from_another_origin() -> None:
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        urls = set(re.findall(r"[a-z]+://[^\s\"'`)]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, (path.name, urls)
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text


def test_request_timeline_in_flight_then_finished(tiny_server) -> None:
    tiny_server.wait_idle()
    secret = "a prompt nobody else may read"
    # long enough that the request is still decoding when its entry is read, on a busy host
    with stream_completion(tiny_server.base_url, "timeline-1", secret, 200) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        live = entry(tiny_server.base_url, "timeline-1")
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert live["status"] in ("prefilling", "decoding") and live["end_time"] is None
    assert live["segments"][-1]["end"] is None and live["ttft"] is not None
    usage = events[-1]["usage"]

    done = entry(tiny_server.base_url, "timeline-1")
    assert done["status"] == "finished" and done["finish_reason"] == "length"
    assert done["prompt_tokens"] == usage["prompt_tokens"]
    assert done["output_tokens"] == usage["completion_tokens"] == 200
    assert done["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    states = [s["state"] for s in done["segments"]]
    assert states[0] == "queued" and states[-1] == "decoding" and "prefilling" in states
    for before, after in zip(done["segments"], done["segments"][1:], strict=False):
        assert before["end"] == after["start"]
    assert done["segments"][-1]["end"] == done["end_time"]
    assert done["arrival_time"] <= done["first_token_time"] <= done["end_time"]
    assert 0 < done["ttft"] <= done["e2e"] and done["tpot"] > 0
    assert abs(done["end_time"] - time.time()) < 30  # wall-clock seconds
    # without --ui-show-text, no text of any request leaves the server
    body = httpx.get(tiny_server.base_url + "/v1/requests/recent?limit=1000").text
    assert secret not in body and "prompt" not in done and "output" not in done


def test_aborted_request_shows_as_aborted(tiny_server) -> None:
    with stream_completion(tiny_server.base_url, "timeline-abort", "Go on", 200) as response:
        lines = response.iter_lines()
        received = 0
        while received < 3:
            received += next(lines).startswith("data: {")
    tiny_server.wait_idle()
    done = entry(tiny_server.base_url, "timeline-abort")
    assert done["status"] == "aborted" and done["finish_reason"] == "abort"
    assert 3 <= done["output_tokens"] < 200


def test_engine_state_counts_the_tokens_of_each_second(tiny_server) -> None:
    tiny_server.wait_idle()
    time.sleep(1.1)  # the seconds of earlier tests are over
    url = tiny_server.base_url + "/v1/engine/state"
    start = httpx.get(url).json()
    assert start["stats_enabled"] and start["fields"][0] == "t"
    last = start["samples"][-1][0] if start["samples"] else start["time"] - 1
    with stream_completion(tiny_server.base_url, "state-1", "Count", 25) as response:
        for _ in response.iter_lines():
            pass
    tiny_server.wait_idle()
    time.sleep(1.1)  # let the last busy second close
    state = httpx.get(url, params={"since": last}).json()
    col = state["fields"].index
    assert all(row[0] > last for row in state["samples"])
    assert sum(row[col("generation_tokens")] for row in state["samples"]) == 25
    assert max(row[col("running")] for row in state["samples"]) >= 1
    assert state["current"] == {"running": 0, "waiting": 0, "tokens_waiting": 0,
                                "kv_cache_usage": 0.0, "kv_cache_tokens_used": 0}
    assert state["latency"]["ttft"]["count"] >= 1 and state["latency"]["itl"]["p50"] > 0
    assert state["totals"]["finished"]["length"] >= 1
    assert state["config"]["kv_cache_tokens_total"] > 0


def test_limit_out_of_range_is_a_400(tiny_server) -> None:
    response = httpx.get(tiny_server.base_url + "/v1/requests/recent?limit=0")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "limit"


def test_text_and_api_key_options(tiny_model) -> None:
    server = ServerProcess(tiny_model, "--api-key", "k3y", "--ui-show-text",
                           "--disable-log-stats")
    try:
        assert httpx.get(server.base_url + "/").status_code == 200  # the page needs no key
        for path in ("/v1/requests/recent", "/v1/engine/state"):
            assert httpx.get(server.base_url + path).status_code == 401
        state = httpx.get(server.base_url + "/v1/engine/state",
                          headers={"Authorization": "Bearer k3y"}).json()
        assert state["stats_enabled"] is False and "samples" not in state
    finally:
        server.stop()
