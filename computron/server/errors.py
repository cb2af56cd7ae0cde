"""HTTP errors in the shapes clients expect, from one table.

OpenAI's routes answer ``{"error": {"message", "type", "param", "code"}}`` (``APIError``); the Open
Inference Protocol under ``/v2`` answers ``{"error": "message"}`` (``V2Error``). ``ERROR_TABLE`` maps each
engine error (``computron.errors``), the chat-template error, and the errors of a model added while serving
(a bad config or LoRA adapter: 400; a change of an id under way: 409; a build that failed: 500), and a
client that went away (499: read by no one but the metrics) to its status, OpenAI type and code, and a
``Retry-After`` for a full queue; ``to_openai`` and ``to_v2`` both read it, and either shape converts to the
other. A ``PayloadError`` names the request field at fault: OpenAI's answer has it as ``param`` (in the
client's name of it: ``prompt`` for the engine's ``input_ids``) and its reason without the engine's
``model 'x': malformed request:`` prefix; v2's answer says ``input 'x': reason`` (``payload_message``).
Anything else is a bug: logged, and answered 500 ``internal_error``.

Pure Python: ``app.py`` installs the handlers that answer FastAPI's own errors (404, 405, 422) and whatever
a route raises in these shapes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..errors import (EngineDeadError, ModelChangeError, ModelConflictError, PayloadError, QueueFullError,
                      RequestTimeoutError, UnknownModelError, WorkerError)
from ..lora.adapter import AdapterError
from ..preflight import PreflightError
from .config import ConfigError
from .text import ChatTemplateError

log = logging.getLogger("computron.server")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class V2Error(Exception):
    """An error answered in the v2 shape: ``{"error": message}``."""

    def __init__(self, status: int, message: str, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}

    def body(self) -> Dict[str, Any]:
        return {"error": self.message}


class ClientGone(Exception):
    """The client disconnected before its answer was ready: before its body was read, or while its work
    ran (counted as 499)."""


def bad(param: Optional[str], message: str) -> APIError:
    """400 for a bad request field (``param``: OpenAI's name of it, None for the body as a whole)."""
    return APIError(400, message, "invalid_request_error", param, "invalid_value")


@dataclass(frozen=True)
class ErrorKind:
    """How one kind of error answers: its status and OpenAI ``type`` and ``code``."""
    status: int
    type: str
    code: str
    param: Optional[str] = None
    """The request field at fault, when it is always the same one."""
    retry_after: bool = False
    """Answer ``Retry-After``: the error's ``retry_after_s`` (whole seconds, the expected wait), else 1."""
    code_from_reason: bool = False
    """The OpenAI ``code`` is the error's ``reason`` (a refusal's: ``queue_full``, ``ttft_late``)."""

    def headers(self, exc: Optional[BaseException] = None) -> Dict[str, str]:
        return {"Retry-After": str(getattr(exc, "retry_after_s", 1))} if self.retry_after else {}

    def code_of(self, exc: BaseException) -> str:
        return getattr(exc, "reason", self.code) if self.code_from_reason else self.code


ERROR_TABLE: Tuple[Tuple[type, ErrorKind], ...] = (
    (UnknownModelError, ErrorKind(404, "invalid_request_error", "model_not_found", param="model")),
    (ChatTemplateError, ErrorKind(400, "invalid_request_error", "chat_template_missing", param="messages")),
    (PayloadError, ErrorKind(400, "invalid_request_error", "invalid_payload")),
    (QueueFullError, ErrorKind(429, "rate_limit_error", "queue_full", retry_after=True, code_from_reason=True)),
    (RequestTimeoutError, ErrorKind(504, "timeout_error", "request_timeout")),
    (EngineDeadError, ErrorKind(503, "service_unavailable", "engine_dead")),
    (WorkerError, ErrorKind(500, "server_error", "worker_error")),
    # changes of the served models (the repository API, a model repository's first request)
    (ConfigError, ErrorKind(400, "invalid_request_error", "invalid_model_config")),
    (PreflightError, ErrorKind(400, "invalid_request_error", "invalid_model_config")),
    (AdapterError, ErrorKind(400, "invalid_request_error", "invalid_adapter")),
    (ModelConflictError, ErrorKind(409, "invalid_request_error", "model_conflict")),
    (ModelChangeError, ErrorKind(500, "server_error", "model_load_failed")),
    (ClientGone, ErrorKind(499, "invalid_request_error", "client_closed_request")),
)
"""Engine, text and model-change errors, and a client gone; first match wins."""


def error_kind(exc: BaseException) -> Optional[ErrorKind]:
    """``exc``'s row of ``ERROR_TABLE``; None for an unexpected error."""
    return next((kind for cls, kind in ERROR_TABLE if isinstance(exc, cls)), None)


def _internal(exc: BaseException) -> APIError:
    log.exception("unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")


def to_openai(exc: BaseException, params: Optional[Dict[str, str]] = None) -> APIError:
    """OpenAI's answer to ``exc``. ``params`` maps engine request fields to the names the client used
    (``input_ids`` -> ``prompt``), for a ``PayloadError``'s ``param``."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, V2Error):
        return APIError(exc.status, exc.message, headers=exc.headers)
    kind = error_kind(exc)
    if kind is None:
        return _internal(exc)
    if isinstance(exc, PayloadError):
        reason = exc.reason if exc.row is None else f"input[{exc.row}]: {exc.reason}"
        return APIError(kind.status, reason, kind.type, (params or {}).get(exc.param, exc.param), kind.code)
    return APIError(kind.status, str(exc), kind.type, kind.param, kind.code_of(exc), kind.headers(exc))


def to_v2(exc: BaseException) -> V2Error:
    """The v2 answer to ``exc``."""
    if isinstance(exc, V2Error):
        return exc
    kind = error_kind(exc)
    if kind is None:
        err = exc if isinstance(exc, APIError) else _internal(exc)
        return V2Error(err.status, err.message, err.headers)
    message = payload_message(exc, exc.row) if isinstance(exc, PayloadError) else str(exc)
    return V2Error(kind.status, message, kind.headers(exc))


def payload_message(exc: BaseException, row: Optional[int] = None, name: Optional[str] = None) -> str:
    """A batch manager's objection as v2 words it: ``input 'image': row 0: ...`` naming the input the
    error's ``param`` names (else ``name``), without the engine's ``model 'x': malformed request:`` prefix."""
    name = getattr(exc, "param", None) or name
    reason = getattr(exc, "reason", None) or str(exc)
    if name is None:
        return reason if row is None else f"row {row}: {reason}"
    if reason.startswith(f"{name}: "):
        reason = reason[len(name) + 2:]
    return f"input {name!r}: " + ("" if row is None else f"row {row}: ") + reason
