"""The gate every HTTP request passes before a route sees it (a plain ASGI middleware).

In order: the body-size cap (413), the API key on ``/v1/*`` (401; ``Authorization: Bearer
KEY``, or Anthropic's ``x-api-key: KEY``), the ``x-request-id``
length cap (400), admission while draining (503 with ``Retry-After``). The request id,
the client's or a new one, goes to ``request.state.request_id`` and back out in the
response's ``x-request-id`` header.

The body is read here, up to the cap, and replayed to the route; after it, ``receive``
is the server's own, so a route can still wait for ``http.disconnect``.
"""

from __future__ import annotations

import hashlib
import hmac
import uuid
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.config import RequestLimits
from tokenmill.errors import InvalidParameterError
from tokenmill.server.errors import error_response_for
from tokenmill.server.lifecycle import ServerLifecycle


class _BodyTooLarge(Exception):
    pass


def api_key_matches(authorization: str | None, keys: Sequence[str]) -> bool:
    """``Authorization: Bearer KEY`` for one of ``keys``, compared in constant time.

    Every key is compared, so the time taken says nothing about which one came close.
    """
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    return key_matches(given, keys)


def key_matches(given: str, keys: Sequence[str]) -> bool:
    """``given`` is one of ``keys``, compared in constant time (as ``api_key_matches``)."""
    supplied = _digest(given)
    matches = [hmac.compare_digest(supplied, _digest(key)) for key in keys]
    return any(matches)


def _digest(key: str) -> bytes:
    """Fixed-length digests, so that not even a key's length shows in the timing."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class RequestGate:
    def __init__(self, app: ASGIApp, limits: RequestLimits, api_keys: Sequence[str],
                 lifecycle: ServerLifecycle) -> None:
        self.app = app
        self.limits = limits
        self.api_keys = tuple(api_keys)
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        refusal = self._refusal(scope, headers, request_id)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        try:
            body = await self._read_body(receive)
        except _BodyTooLarge:
            await self._too_large(scope["path"])(scope, receive, send)
            return
        scope.setdefault("state", {})["request_id"] = request_id
        await self.app(scope, _replay(body, receive), _with_request_id(send, request_id))

    def _refusal(self, scope: Scope, headers: Headers, request_id: str):
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.limits.max_request_body_bytes:
            return self._too_large(scope["path"])
        path = scope["path"]
        if self.api_keys and path.startswith("/v1"):
            x_api_key = headers.get("x-api-key")
            if not (api_key_matches(headers.get("authorization"), self.api_keys)
                    or (x_api_key and key_matches(x_api_key, self.api_keys))):
                return error_response_for(path, 401, "invalid or missing API key", None,
                                          "invalid_api_key")
        try:
            self.limits.check_request_id(request_id)
        except InvalidParameterError as error:
            return error_response_for(path, 400, str(error), error.param)
        if self.lifecycle.draining and scope["method"] == "POST":
            response = error_response_for(path, 503, "the server is shutting down", None,
                                          "shutting_down")
            response.headers["retry-after"] = self.lifecycle.retry_after
            return response
        return None

    def _too_large(self, path: str):
        cap = self.limits.max_request_body_bytes
        return error_response_for(path, 413, f"the request body is larger than {cap} bytes", None,
                              "request_too_large")

    async def _read_body(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body
                return b""
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_request_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_request_id(send: Send, request_id: str) -> Send:
    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []),
                                               (b"x-request-id", request_id.encode("latin-1"))]}
        await send(message)

    return send_with_id
