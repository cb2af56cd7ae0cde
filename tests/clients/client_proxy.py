"""A recording reverse proxy between a client under test and ``computron serve``: every request is forwarded
as it is (streamed answers pass through chunk by chunk) and kept as an ``Exchange`` (method, path, JSON body,
status, and the answer's text when it was refused), so that a test can say exactly which request a client sent
and which of them the server refused, whatever the route (a 404 for a route the server lacks never reaches
the server's own metrics)."""
from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from serve_helpers import app_in_thread

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
_KEEP = 4096
"""Characters of a refused answer kept (its error message)."""


@dataclass
class Exchange:
    method: str
    path: str
    body: Any
    """The request's JSON body (None when it had none or was not JSON)."""
    status: int = 0
    answer: str = ""
    """The answer's text, kept when refused (status >= 400) or when a stream carried an error event."""
    stream_error: bool = False

    @property
    def refused(self) -> bool:
        return self.status >= 400 or self.stream_error

    def describe(self) -> str:
        fields = sorted(self.body) if isinstance(self.body, dict) else self.body
        what = "an error event in its stream" if self.stream_error and self.status < 400 else str(self.status)
        return f"{self.method} {self.path} -> {what}: {self.answer.strip()[:400]} (request fields: {fields})"


class RecordingProxy:
    """``with RecordingProxy(upstream).serve() as url:`` forwards ``url/...`` to ``upstream/...``."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self._lock = threading.Lock()
        self.exchanges: List[Exchange] = []

    # ---- what was sent ---------------------------------------------------------------------------------
    def requests(self, path: Optional[str] = None) -> List[Exchange]:
        with self._lock:
            return [x for x in self.exchanges if path is None or x.path == path]

    def refused(self) -> List[Exchange]:
        return [x for x in self.requests() if x.refused]

    def clear(self) -> None:
        with self._lock:
            self.exchanges.clear()

    def refusals_message(self, client: str) -> str:
        """The failure message of a client run with refused requests: one line per distinct refusal."""
        seen: Dict[str, int] = {}
        for x in self.refused():
            line = x.describe()
            seen[line] = seen.get(line, 0) + 1
        lines = [f"  {n} x {line}" for line, n in seen.items()]
        return (f"{client}: the server refused {sum(seen.values())} of {len(self.requests())} requests "
                f"(feature missing on the server):\n" + "\n".join(lines))

    # ---- the proxy -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        clients: List[httpx.AsyncClient] = []

        @contextlib.asynccontextmanager
        async def lifespan(app):  # the upstream client lives in uvicorn's event loop
            clients.append(httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(600.0, connect=30.0)))
            try:
                yield
            finally:
                await clients[0].aclose()

        async def forward(request: Request):
            client = clients[0]
            raw = await request.body()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            x = Exchange(request.method, request.url.path, body)
            with self._lock:
                self.exchanges.append(x)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
            up = await client.send(client.build_request(request.method, request.url.path,
                                                        params=request.query_params, headers=headers,
                                                        content=raw), stream=True)
            x.status = up.status_code
            out = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
            if x.status >= 400:  # read whole, whether or not the client reads it
                try:
                    raw = await up.aread()
                finally:
                    await up.aclose()
                x.answer = raw.decode("utf-8", "replace")[:_KEEP]
                return Response(raw, status_code=x.status, headers=out)
            sse = "text/event-stream" in up.headers.get("content-type", "")

            async def relay():
                tail = ""
                try:
                    async for chunk in up.aiter_raw():
                        if sse:  # an error after the first token ends the stream with an error event
                            text = tail + chunk.decode("utf-8", "replace")
                            if any(line.startswith('data: {"error"') for line in text.splitlines()):
                                x.stream_error, x.answer = True, text[:_KEEP]
                            tail = text[-256:]
                        yield chunk
                finally:
                    await up.aclose()
            return StreamingResponse(relay(), status_code=up.status_code, headers=out)

        methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
        app = Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)
        with app_in_thread(app) as url:
            yield url
