"""Streaming usage exactly as SPEC section 2 promises, through the real server and the
official ``openai`` client."""

from __future__ import annotations

import json

import httpx
import pytest

GREEDY = {"temperature": 0.0}


def sse_events(base_url: str, path: str, body: dict) -> list:
    """The decoded ``data:`` events of one streamed request ([DONE] as the string)."""
    events = []
    with httpx.stream("POST", base_url + path, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_stream_text_equals_non_stream_text(client) -> None:
    kwargs = dict(model="tiny", prompt="The quick brown fox", max_tokens=24, **GREEDY)
    full = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == full.choices[0].text
    assert full.usage.completion_tokens > 0


@pytest.mark.parametrize("include_usage,continuous", [
    (None, None), (False, True), (True, None), (True, False), (True, True)])
def test_stream_options_table(tiny_server, include_usage, continuous) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True, "stream": True,
            **GREEDY}
    options = {k: v for k, v in (("include_usage", include_usage),
                                 ("continuous_usage_stats", continuous)) if v is not None}
    if options:
        body["stream_options"] = options
    events = sse_events(tiny_server.base_url, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    if not include_usage:
        assert all("usage" not in c for c in chunks)
        assert len(chunks) == 6
        return
    *token_chunks, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    assert final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + 6
    assert len(token_chunks) == 6
    if continuous:
        assert [c["usage"]["completion_tokens"] for c in token_chunks] == [1, 2, 3, 4, 5, 6]
    else:
        assert all("usage" not in c for c in token_chunks)


def test_stream_options_without_stream_is_rejected(tiny_server) -> None:
    r = httpx.post(tiny_server.base_url + "/v1/completions", json={
        "prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options"


def test_exact_per_chunk_usage_for_40_tokens(client) -> None:
    stream = client.completions.create(
        model="tiny", prompt="Count with me:", max_tokens=40, stream=True, extra_body={
            "ignore_eos": True}, stream_options={"include_usage": True,
                                                 "continuous_usage_stats": True}, **GREEDY)
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices]
    counts = [c.usage.completion_tokens for c in token_chunks]
    assert counts == list(range(1, 41))  # strictly +1 per chunk, even when text is ""
    prompt_tokens = {c.usage.prompt_tokens for c in chunks}
    assert len(prompt_tokens) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert token_chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_stream_with_per_choice_usage(client) -> None:
    stream = client.completions.create(
        model="tiny", prompt="Three ways to say hello", max_tokens=5, n=3, stream=True,
        temperature=1.0, seed=7, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    per_choice: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        per_choice.setdefault(choice.index, []).append(chunk.usage.completion_tokens)
    assert per_choice == {0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4, 5], 2: [1, 2, 3, 4, 5]}
    final = chunks[-1]
    prompt_tokens = chunks[0].usage.prompt_tokens
    assert final.usage.prompt_tokens == prompt_tokens  # once per prompt, not per choice
    assert final.usage.completion_tokens == 15


def test_echo_is_not_counted_as_completion(client) -> None:
    prompt = "Echo this prompt back"
    result = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True,
                                       extra_body={"ignore_eos": True}, **GREEDY)
    assert result.choices[0].text.startswith(prompt)
    assert result.usage.completion_tokens == 4
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, echo=True, stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY)
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].text.startswith(prompt)
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 4]
    assert "".join(c.choices[0].text for c in chunks) == result.choices[0].text


def test_chat_stream_with_usage_and_content_parts(client) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY)
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert [c.usage.completion_tokens for c in content] == list(range(1, 9))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                          extra_body={"ignore_eos": True}, **GREEDY)
    assert full.choices[0].message.content == "".join(c.choices[0].delta.content
                                                      for c in content)


def test_per_request_metrics_opt_in(tiny_server) -> None:
    events = sse_events(tiny_server.base_url, "/v1/completions", {
        "prompt": "metrics please", "max_tokens": 5, "n": 2, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "include_metrics": True}, **GREEDY})
    final = events[-2]
    assert [m["index"] for m in final["metrics"]] == [0, 1]
    for m in final["metrics"]:
        assert m["num_generation_tokens"] == 5 and m["finish_reason"] == "length"
        assert 0 <= m["queue_time"] <= m["time_to_first_token"] <= m["e2e_latency"]
        assert m["decode_time"] <= m["inference_time"]
    r = httpx.post(tiny_server.base_url + "/v1/completions", json={
        "prompt": "metrics please", "max_tokens": 3, "include_metrics": True, **GREEDY}).json()
    assert r["metrics"][0]["num_prompt_tokens"] == r["usage"]["prompt_tokens"]
    plain = httpx.post(tiny_server.base_url + "/v1/completions", json={
        "prompt": "metrics please", "max_tokens": 3, **GREEDY}).json()
    assert "metrics" not in plain
