"""HTTP errors in the shapes clients expect.

Everything but ``/v2`` answers in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``;
``/v2`` (the Open Inference Protocol) answers ``{"error": "message"}``. ``api_error`` maps engine and text
errors to OpenAI's statuses (a ``PayloadError`` keeps the field it names as ``param``, without the engine's
``model 'x': malformed request:`` prefix); ``install_handlers`` gives FastAPI's own answers (404 unknown
route, 405 wrong method, 422 invalid parameters, answered 400, and 500 uncaught) the same shapes.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (EngineDeadError, PayloadError, QueueFullError, RequestTimeoutError, UnknownModelError,
                      WorkerError)
from .text import ChatTemplateError

log = logging.getLogger("computron.server")

dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def json_response(body: Any, status: int = 200, headers: Optional[dict] = None) -> Response:
    return Response(dumps(body), status_code=status, media_type="application/json", headers=headers)


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return json_response(self.body(), self.status, self.headers)


def bad(param: Optional[str], message: str) -> APIError:
    """400 for a bad request field (``param``: OpenAI's name of it, None for the body as a whole)."""
    return APIError(400, message, "invalid_request_error", param, "invalid_value")


def api_error(exc: BaseException, params: Optional[Dict[str, str]] = None) -> APIError:
    """The HTTP answer for an engine or text error. ``params`` maps engine request fields to the names the
    client used (``input_ids`` -> ``prompt``), for a ``PayloadError``'s ``param``."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, UnknownModelError):
        return APIError(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, ChatTemplateError):
        return APIError(400, str(exc), "invalid_request_error", "messages", "chat_template_missing")
    if isinstance(exc, PayloadError):
        return APIError(400, exc.reason, "invalid_request_error", (params or {}).get(exc.param, exc.param),
                        "invalid_payload")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), "rate_limit_error", None, "queue_full", {"Retry-After": "1"})
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, str(exc), "timeout_error", None, "request_timeout")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable", None, "engine_dead")
    if isinstance(exc, WorkerError):
        return APIError(500, str(exc), "server_error", None, "worker_error")
    log.exception("unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")


def is_v2(request: Request) -> bool:
    path = request.url.path
    return path == "/v2" or path.startswith("/v2/")


def error_response(request: Request, err: APIError) -> Response:
    """``err`` in the shape of the route asked for: v2's under /v2, OpenAI's elsewhere."""
    if is_v2(request):
        return json_response({"error": err.message}, err.status, err.headers)
    return err.response()


def _http_error(request: Request, exc: StarletteHTTPException) -> APIError:
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return APIError(404, f"Invalid URL ({where}): no such route", "invalid_request_error", None, "not_found")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return APIError(405, f"Method not allowed ({where}); allowed: {allowed}", "invalid_request_error", None,
                        "method_not_allowed", exc.headers)
    return APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, None, exc.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    first = (exc.errors() or [{}])[0]
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    return bad(param, f"{param}: {msg}" if param else msg)


def install_handlers(app: FastAPI) -> None:
    """Answer FastAPI's own errors (unknown route, wrong method, invalid parameters, uncaught) in the shape
    of the route asked for."""

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException):
        return error_response(request, _http_error(request, exc))

    @app.exception_handler(RequestValidationError)
    async def validation_exception(request: Request, exc: RequestValidationError):
        return error_response(request, _validation_error(exc))

    @app.exception_handler(Exception)
    async def internal_exception(request: Request, exc: Exception):
        return error_response(request, api_error(exc))
