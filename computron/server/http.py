"""HTTP plumbing the routers share: JSON in and out, server-sent events, clients that go away.

One body reader (``read_body``; ``read_json``: 400 when the body is not JSON), one JSON writer
(``json_response``: compact UTF-8; ``error_response`` for an ``APIError`` or ``V2Error``), the
event-stream answer (``sse``, ``sse_response``), and ``unless_disconnected``, which awaits a
request's work in the route's own task and cancels it, raising ``ClientGone``, when the client
disconnects first: a cancelled engine request frees its slot at once.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Dict, Optional, TypeVar, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from .errors import APIError, ClientGone, V2Error, bad

T = TypeVar("T")

dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

SSE_DONE = b"data: [DONE]\n\n"
"""The last event of every OpenAI stream, after its answer or its error."""


def json_response(body: Any, status: int = 200, headers: Optional[dict] = None) -> Response:
    return Response(dumps(body), status_code=status, media_type="application/json", headers=headers)


def error_response(err: Union[APIError, V2Error]) -> Response:
    return json_response(err.body(), err.status, err.headers)


async def read_body(request: Request) -> bytes:
    """The request's body; ``ClientGone`` when the client closed its connection first. (The server may
    read a body late, once the client has given up: uvicorn then answers a disconnect, not the bytes.)"""
    try:
        return await request.body()
    except ClientDisconnect:
        raise ClientGone() from None


async def read_json(request: Request) -> Any:
    """The request's JSON body; 400 (``APIError``, which ``to_v2`` turns into v2's shape) when it is not JSON."""
    raw = await read_body(request)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise bad(None, f"the request body is not valid JSON: {exc}") from None


def sse(obj: Dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + dumps(obj).encode() + b"\n\n"


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw`` in this task unless the client goes first: then cancel it (which cancels the engine's
    sequence) and raise ClientGone. The work stays in the caller's task: the engine's iterators may hold
    task-bound state (timeouts)."""
    me = asyncio.current_task()
    flags = {"done": False, "gone": False}

    def on_gone(f: asyncio.Future) -> None:
        if not flags["done"] and not f.cancelled() and f.exception() is None:
            flags["gone"] = True
            me.cancel()
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    watcher.add_done_callback(on_gone)
    try:
        return await aw
    except asyncio.CancelledError:
        if flags["gone"]:
            if hasattr(me, "uncancel"):  # Python >= 3.11 counts cancellations
                me.uncancel()
            raise ClientGone() from None
        raise
    finally:
        flags["done"] = True
        watcher.cancel()
