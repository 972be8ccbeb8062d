"""OpenAI-style error bodies, and the exception handlers that produce them.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}``, in
OpenAI's form: ``code`` is a string naming a condition a client may act on
(``invalid_api_key``, ``model_not_found``, ``request_too_large``, ``shutting_down``,
``max_num_queued_requests``, ``max_num_queued_tokens``) or ``null``; never the HTTP status
(vLLM puts the status there; here it is only the response's status line, and ``type``).

Anthropic's endpoints (``/v1/messages``...) answer in Anthropic's shape instead:
``{"type": "error", "error": {"type", "message"}}``, with the same status
(``error_response_for`` picks the shape by the request's path).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tokenmill.errors import InvalidParameterError
from tokenmill.frontend.async_client import AdmissionRejected

logger = logging.getLogger("tokenmill")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    if code is not None and not isinstance(code, str):
        raise TypeError(f"an error code is a string or None, not {code!r}")
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    404: "not_found_error", 405: "invalid_request_error",
                    413: "request_too_large", 500: "api_error", 503: "overloaded_error"}
ANTHROPIC_PATH = "/v1/messages"


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                       "message": message}}


def error_response_for(path: str, status: int, message: str, param: str | None = None,
                       code: str | None = None) -> JSONResponse:
    """The error in the shape of the API that ``path`` belongs to."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return JSONResponse(anthropic_error_body(status, message), status_code=status)
    return error_response(status, message, param, code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query")]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return f"{where}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response_for(request.url.path, 400, message, param)

    @app.exception_handler(InvalidParameterError)
    async def _invalid(request: Request, exc: InvalidParameterError) -> JSONResponse:
        return error_response_for(request.url.path, 400, str(exc), exc.param)

    @app.exception_handler(AdmissionRejected)
    async def _rejected(request: Request, exc: AdmissionRejected) -> JSONResponse:
        return error_response_for(request.url.path, 503, str(exc), None, exc.reason)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response_for(request.url.path, exc.status, exc.message, exc.param,
                                  exc.code)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response_for(request.url.path, exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed", exc_info=exc)
        return error_response_for(request.url.path, 500, "internal server error")
