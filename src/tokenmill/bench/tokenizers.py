"""Ways to measure a prompt's length in tokens, best first.

1. ``ServerTokenCounter``: the server's ``POST /tokenize`` (vLLM, tokenmill)
   ``{"model", "prompt"} -> {"tokens": [...], "count": n}``; counts exactly what the
   server will see, special tokens included.
2. ``LocalTokenCounter``: a local Hugging Face tokenizer folder (``--tokenizer``).
   It is also the fallback for counting *output* tokens when the server sends no usage.
3. ``WordTokenCounter``: one token per whitespace-separated word; an approximation,
   and the report says so.

Each has ``method`` (named in the report) and ``async count(text) -> int``.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

import aiohttp

from tokenmill.bench.config import BenchSetupError
from tokenmill.bench.stream import REQUEST_ERRORS, error_message


class TokenCounter(Protocol):
    method: str

    async def count(self, text: str) -> int: ...


class ServerTokenCounter:
    method = "server /tokenize"

    def __init__(self, client: aiohttp.ClientSession, url: str, model: str,
                 headers: dict[str, str]) -> None:
        self._client, self._url, self._model, self._headers = client, url, model, headers

    @classmethod
    async def probe(cls, client: aiohttp.ClientSession, base_url: str, model: str,
                    headers: dict[str, str]) -> ServerTokenCounter | None:
        """The counter if the server answers ``/tokenize`` sensibly, else None."""
        counter = cls(client, f"{base_url}/tokenize", model, headers)
        try:
            await counter.count("hello world")
        except (*REQUEST_ERRORS, BenchSetupError):
            return None
        return counter

    async def count(self, text: str) -> int:
        async with self._client.post(self._url, json={"model": self._model, "prompt": text},
                                     headers=self._headers) as resp:
            status, content = resp.status, await resp.read()
        if status != 200:
            raise BenchSetupError(f"/tokenize answered HTTP {status}: {error_message(content)}")
        try:
            body = json.loads(content)
        except ValueError as exc:
            text = content[:200].decode("utf-8", "replace")
            raise BenchSetupError(f"/tokenize answered non-JSON: {text!r}") from exc
        if isinstance(body, dict) and isinstance(body.get("count"), int):
            return body["count"]
        if isinstance(body, dict) and isinstance(body.get("tokens"), list):
            return len(body["tokens"])
        raise BenchSetupError(f"/tokenize answered without count or tokens: {body!r:.200}")


class LocalTokenCounter:
    method = "local tokenizer"

    def __init__(self, path: str) -> None:
        """Load a Hugging Face tokenizer from the folder ``path``; never downloads."""
        if not os.path.isdir(path):
            raise BenchSetupError(f"--tokenizer {path} is not a folder")
        try:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises many types for a bad folder
            raise BenchSetupError(f"cannot load a tokenizer from {path}: {exc}") from exc

    async def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=True))

    def count_output(self, text: str) -> int:
        """Tokens of generated text: no special tokens added."""
        return len(self._tokenizer.encode(text, add_special_tokens=False))


class WordTokenCounter:
    method = "words (approximate: one token per word)"

    async def count(self, text: str) -> int:
        return len(text.split())
