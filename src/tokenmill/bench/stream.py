"""One streaming request against an OpenAI-compatible server, recorded as it arrives.

``send()`` fills a ``RawResponse`` and never raises for server behaviour: an HTTP
error, an ``{"error": ...}`` event, a malformed event or a dropped connection all end
with ``status = FAILED`` and keep what was received before. Cancellation (a duration
run ending) propagates; ``end_s`` is still set and ``status`` stays ``None`` so the
caller can mark the request cut off.

Server-sent events are read line by line; only ``data:`` lines matter::

    data: {"choices": [{"index": 0, "text": " a"}], "usage": {"completion_tokens": 1, ...}}
    data: {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 5, ...}}
    data: {"error": {"message": "..."}, "usage": {...}}        (tokenmill: error mid-stream)
    data: [DONE]
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from tokenmill.bench.records import RawResponse, Status, StreamEvent

# Asked for in this order; the warm-up falls back to the next when a server rejects one.
STREAM_OPTIONS_CHOICES: tuple[dict | None, ...] = (
    {"include_usage": True, "continuous_usage_stats": True},
    {"include_usage": True},
    None,
)


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send requests; builds each request's JSON body."""

    url: str
    chat: bool
    model: str
    headers: dict[str, str]
    ignore_eos: bool
    stream_options: dict | None
    temperature: float | None = None
    logprobs: int | None = None

    def payload(self, prompt: str, max_tokens: int) -> dict:
        body: dict = {"model": self.model, "max_tokens": max_tokens, "stream": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.stream_options is not None:
            body["stream_options"] = self.stream_options
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.logprobs is not None:  # the completions and the chat API ask differently
            body.update({"logprobs": True, "top_logprobs": self.logprobs} if self.chat
                        else {"logprobs": self.logprobs})
        return body


# What a failed request raises: the connection refused, dropped or cut short, or a
# timeout (``--timeout``: connecting, or waiting for the next chunk).
REQUEST_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


async def send(client: aiohttp.ClientSession, endpoint: Endpoint, prompt: str,
               raw: RawResponse, run_start_ts: float) -> None:
    """Stream one request into ``raw`` (see the module docstring for the outcomes)."""
    sent_ts = time.perf_counter()
    raw.start_s = sent_ts - run_start_ts
    payload = endpoint.payload(prompt, raw.max_tokens)
    try:
        async with client.post(endpoint.url, json=payload, headers=endpoint.headers) as resp:
            raw.http_status = resp.status
            if resp.status != 200:
                _fail(raw, f"HTTP {resp.status}: {error_message(await resp.read())}")
            else:
                await _read_events(resp, sent_ts, raw)
    except REQUEST_ERRORS as exc:
        _fail(raw, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    finally:
        raw.end_s = time.perf_counter() - sent_ts


async def _lines(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The body's lines as they arrive (without their line ends), however long."""
    pending = b""
    async for data in resp.content.iter_any():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if pending:
        yield pending.rstrip(b"\r").decode("utf-8", "replace")


async def _read_events(resp: aiohttp.ClientResponse, sent_ts: float, raw: RawResponse) -> None:
    saw_finish = False
    async for line in _lines(resp):
        ts_s = time.perf_counter() - sent_ts
        if not line.startswith("data:"):
            continue  # blank separators, comments, "event:" lines
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            raw.finished = True
            break
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            _fail(raw, f"malformed event: {data[:200]!r}")
            return
        if not isinstance(event, dict):
            _fail(raw, f"malformed event: {data[:200]!r}")
            return
        _take_usage(event.get("usage"), raw, final=not event.get("choices"))
        if "error" in event:
            _fail(raw, f"error event: {_describe_error(event['error'])}")
            return
        saw_finish |= _take_choices(event.get("choices"), event.get("usage"), ts_s, raw)
    if raw.finished or saw_finish:
        raw.finished = True
        raw.status = Status.OK
    else:
        _fail(raw, "stream ended before [DONE]")


def _take_usage(usage: object, raw: RawResponse, final: bool) -> None:
    """Prompt tokens from any usage; completion tokens from a usage with no choice."""
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("prompt_tokens"), int):
        raw.usage_prompt_tokens = usage["prompt_tokens"]
    if final and isinstance(usage.get("completion_tokens"), int):
        raw.final_completion_tokens = usage["completion_tokens"]


def _take_choices(choices: object, usage: object, ts_s: float, raw: RawResponse) -> bool:
    """Append one event per choice; return whether any choice carried a finish_reason."""
    if not isinstance(choices, list):
        return False
    cumulative = None
    # NOTE: cumulative usage belongs to a choice only when the chunk carries exactly one.
    if isinstance(usage, dict) and len(choices) == 1:
        value = usage.get("completion_tokens")
        cumulative = value if isinstance(value, int) else None
    finished = False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        text = choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
        index = choice.get("index") if isinstance(choice.get("index"), int) else 0
        raw.events.append(StreamEvent(ts_s, index, text, cumulative))
        finished |= choice.get("finish_reason") is not None
    return finished


def _fail(raw: RawResponse, error: str) -> None:
    raw.status = Status.FAILED
    raw.error = error


def _describe_error(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def error_message(body: bytes) -> str:
    """The message of an OpenAI-style (or FastAPI ``detail``) error body, else its text."""
    try:
        decoded = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body.decode("utf-8", "replace")[:200]
    if isinstance(decoded, dict):
        if "error" in decoded:
            return _describe_error(decoded["error"])
        if "detail" in decoded:
            return str(decoded["detail"])[:200]
    return str(decoded)[:200]
