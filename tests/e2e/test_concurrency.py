"""Batched streaming: concurrent streams progress together; a client that goes away,
streaming or not, has its request aborted and its blocks freed."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
from openai import AsyncOpenAI


def test_32_concurrent_streams_start_before_the_first_finishes(tiny_server) -> None:
    async def one(client: AsyncOpenAI, i: int) -> tuple[float, float, int]:
        stream = await client.completions.create(
            model="tiny", prompt=f"Stream number {i} says", max_tokens=48, stream=True,
            temperature=0.0, extra_body={"ignore_eos": True})
        first = None
        count = 0
        async for chunk in stream:
            if chunk.choices and first is None:
                first = time.monotonic()
            count += bool(chunk.choices)
        return first, time.monotonic(), count

    async def main():
        client = AsyncOpenAI(base_url=tiny_server.base_url + "/v1", api_key="x", max_retries=0)
        results = await asyncio.gather(*(one(client, i) for i in range(32)))
        await client.close()
        return results

    results = asyncio.run(main())
    assert all(count == 48 for _, _, count in results)
    first_finish = min(end for _, end, _ in results)
    started_before = sum(first < first_finish for first, _, _ in results)
    assert started_before >= 28, started_before


def test_client_disconnect_aborts_and_frees_blocks(tiny_server) -> None:
    before = tiny_server.metrics()
    with httpx.stream("POST", tiny_server.base_url + "/v1/completions", json={
            "prompt": "A very long story", "max_tokens": 200, "ignore_eos": True,
            "stream": True}, headers={"x-request-id": "left-mid-stream"},
            timeout=30) as response:
        lines = response.iter_lines()
        received = 0
        while received < 3:
            received += next(lines).startswith("data: ")
    after = tiny_server.wait_idle()
    aborted = "tokenmill_request_success_total{finished_reason=abort}"
    assert after[aborted] == before[aborted] + 1
    generated = (after["tokenmill_generation_tokens_total"]
                 - before["tokenmill_generation_tokens_total"])
    assert 3 <= generated < 200  # the aborted request's tokens still count
    assert "request left-mid-stream: client disconnected; choice 0 ended: abort" \
        in tiny_server.log()


def test_departed_non_streaming_client_is_aborted(tiny_server) -> None:
    """A non-streaming request whose client disconnects is aborted at the next engine
    step, counted as an abort, and its blocks freed."""
    before = tiny_server.metrics()
    body = json.dumps({"prompt": "A very long story", "max_tokens": 240, "ignore_eos": True})
    with socket.create_connection(("127.0.0.1", tiny_server.port)) as sock:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      f"Content-Type: application/json\r\nx-request-id: left-waiting\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n"
                      f"{body}").encode())
        deadline = time.monotonic() + 30
        while tiny_server.metrics()["tokenmill_generation_tokens_total"] == \
                before["tokenmill_generation_tokens_total"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    after = tiny_server.wait_idle()
    aborted = "tokenmill_request_success_total{finished_reason=abort}"
    assert after[aborted] == before[aborted] + 1
    generated = (after["tokenmill_generation_tokens_total"]
                 - before["tokenmill_generation_tokens_total"])
    assert 1 <= generated < 240
    assert "request left-waiting: client disconnected; choice 0 ended: abort" \
        in tiny_server.log()
