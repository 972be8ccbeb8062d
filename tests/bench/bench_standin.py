"""A tiny OpenAI-compatible stand-in server whose behaviour the URL path chooses.

``http://127.0.0.1:PORT/<scenario>`` is a base URL; the scenario is ``key=value``
pairs joined by ``,`` (see ``Scenario``). Every request generates exactly
``max_tokens`` tokens, the words `` w0`` .. `` w99`` (one token each for the word
tokenizer of ``conftest.word_tokenizer``), ``k`` per chunk.

Failures hit only prompts that start with ``fail``, so the warm-up of a dataset whose
first prompt does not still passes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, fields

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class Scenario:
    usage: str = "continuous"  # continuous: honour stream_options; final: never per chunk; none
    k: int = 1  # tokens per chunk
    delay: float = 0.0  # seconds before each chunk
    fail: str = ""  # "error@N" / "drop@N": after N chunks; "http500": at once
    tokenize: int = 1  # serve POST /tokenize
    reject_continuous: int = 0  # HTTP 400 when continuous_usage_stats is asked for

    @classmethod
    def parse(cls, text: str) -> Scenario:
        types = {f.name: f.type for f in fields(cls)}
        scenario = cls()
        for pair in filter(None, text.split(",")):
            key, value = pair.split("=")
            setattr(scenario, key, {"int": int, "float": float}.get(types[key], str)(value))
        return scenario


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": None, "code": None}}, status_code=status)


class StandIn:
    """The app plus what it sent: ``sent[prompt]`` = tokens written for that prompt."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.active = 0  # streams open now
        self.max_active = 0  # the most open at once; tests reset it
        self.app = FastAPI()
        self.app.get("/{scenario}/v1/models")(self.models)
        self.app.post("/{scenario}/tokenize")(self.tokenize)
        self.app.post("/{scenario}/v1/completions")(self.completions)
        self.app.post("/{scenario}/v1/chat/completions")(self.chat)

    async def models(self, scenario: str) -> dict:
        return {"object": "list", "data": [{"id": "standin", "object": "model"}]}

    async def tokenize(self, scenario: str, request: Request) -> object:
        if not Scenario.parse(scenario).tokenize:
            return _error(404, "Not Found")
        body = await request.json()
        tokens = list(range(len(body["prompt"].split())))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": 4096}

    async def completions(self, scenario: str, request: Request) -> object:
        body = await request.json()
        return self._stream(Scenario.parse(scenario), body, body["prompt"], chat=False)

    async def chat(self, scenario: str, request: Request) -> object:
        body = await request.json()
        return self._stream(Scenario.parse(scenario), body, body["messages"][-1]["content"],
                            chat=True)

    def _stream(self, sc: Scenario, body: dict, prompt: str, chat: bool) -> object:
        options = body.get("stream_options") or {}
        if sc.reject_continuous and "continuous_usage_stats" in options:
            return _error(400, "unknown field stream_options.continuous_usage_stats")
        failing = prompt.startswith("fail")
        if failing and sc.fail == "http500":
            return _error(500, "stand-in refuses")
        usage_on = sc.usage != "none" and options.get("include_usage", False)
        continuous = usage_on and sc.usage == "continuous" and options.get(
            "continuous_usage_stats", False)
        fail_after = int(sc.fail.split("@")[1]) if failing and "@" in sc.fail else None
        return StreamingResponse(
            self._chunks(sc, prompt, body["max_tokens"], chat, usage_on, continuous, fail_after),
            media_type="text/event-stream")

    async def _chunks(self, sc: Scenario, prompt: str, max_tokens: int, chat: bool,
                      usage_on: bool, continuous: bool, fail_after: int | None):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            async for event in self._events(sc, prompt, max_tokens, chat, usage_on, continuous,
                                            fail_after):
                yield event
        finally:
            self.active -= 1

    async def _events(self, sc: Scenario, prompt: str, max_tokens: int, chat: bool,
                      usage_on: bool, continuous: bool, fail_after: int | None):
        num_prompt = len(prompt.split())
        self.sent[prompt] = 0

        def usage(done: int) -> dict:
            return {"prompt_tokens": num_prompt, "completion_tokens": done,
                    "total_tokens": num_prompt + done}

        def chunk(text: str, done: int, finish: str | None) -> dict:
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish}
                      if chat else {"index": 0, "text": text, "finish_reason": finish})
            out = {"id": "x", "created": int(time.time()), "model": "standin", "choices": [choice]}
            if continuous:
                out["usage"] = usage(done)
            return out

        if chat:  # a role-only chunk first, as OpenAI and vLLM send: no token in it
            first = chunk("", 0, None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield _sse(first)
        done = 0
        for num_chunk in range(-(-max_tokens // sc.k)):
            if fail_after is not None and num_chunk == fail_after:
                if sc.fail.startswith("drop"):
                    raise ConnectionError("stand-in drops the connection")
                error = {"error": {"message": "stand-in failed mid-stream", "type": "server_error"}}
                if usage_on:
                    error["usage"] = usage(done)
                yield _sse(error)
                yield "data: [DONE]\n\n"
                return
            await asyncio.sleep(sc.delay)
            k = min(sc.k, max_tokens - done)
            text = "".join(f" w{(done + j) % 100}" for j in range(k))
            done += k
            yield _sse(chunk(text, done, "length" if done == max_tokens else None))
            self.sent[prompt] = done
        if usage_on:
            yield _sse({"id": "x", "model": "standin", "choices": [], "usage": usage(done)})
        yield "data: [DONE]\n\n"


class ServerThread:
    """Runs an app with uvicorn on a free 127.0.0.1 port in a daemon thread."""

    def __init__(self, app: FastAPI) -> None:
        # NOTE: proto=IPPROTO_TCP makes asyncio set TCP_NODELAY on accepted connections;
        # without it Nagle + delayed ACKs hold streamed chunks back by ~40 ms.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="critical", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "stand-in server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
