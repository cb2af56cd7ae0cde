"""The server's state: the served-model registry, the checks before the engine, the API key, accounting.

``create_app`` builds one ``ServerState`` and keeps it on ``app.state.computron``; routes reach it
through the ``served_state`` dependency. It holds:

- ``registry`` (``registry.py``) and its ``models``: one ``ServedModel`` (``building.py``) per id, in
  the order models were given, then added, with its ``ModelKind``, checkpoint path, config entry, and
  the tokenizer of a text generator (``text``) or the ``UnderstandingModel`` of an encoder or ViT model
  (``understanding``); a LoRA adapter's names its ``base`` and shares its base's tokenizer. It changes
  while serving (the repository API, vLLM's LoRA routes, a model repository's first requests):
  inference routes take their model from ``resolve``, which waits for such a load;
- the engine (an ``EngineClient``), the settings, the Prometheus metrics, and ``draining`` (set on
  SIGTERM/SIGINT and at shutdown);
- the checks every inference request passes before it reaches the engine: ``refuse_early`` (right after
  its model id is read, before any other work: a full queue or a predicted-late request is refused at
  once, 429 with ``Retry-After``), ``check_serving`` (not draining, engine alive) and ``admit``.

``api_key(endpoint)`` is the FastAPI dependency of the routes that need a key; ``Call`` counts one
inference request in ``computron_requests`` and logs it at debug level, once, however it ends.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections import Counter
from typing import Any, Awaitable, Callable, Dict, List, Optional, Union

from fastapi import Request
from fastapi.responses import Response

from ..engine.protocol import EngineClient
from ..errors import EngineDeadError, PayloadError, UnknownModelError
from .building import BuiltModel, ServedModel, build_model, generation_of
from .building import UnderstandingModel
from .config import ServerSettings
from .errors import APIError, V2Error
from .field_policy import FieldPolicy
from .http import error_response, unless_disconnected
from .metrics import ServerMetrics
from .model_kind import ModelKind
from .registry import ModelRegistry
from .repository import ModelRepository
from .text import ModelText

log = logging.getLogger("computron.server")

UNKNOWN = "_unknown"
"""The model label of a request whose model is not (yet) known to be served."""


def served_models(texts: Dict[str, ModelText], encoders: Optional[Dict[str, UnderstandingModel]] = None,
                  max_positions: Optional[Dict[str, int]] = None) -> Dict[str, ServedModel]:
    """The registry of ``create_app``'s ready-made arguments: text generators first (with their checkpoint's
    generation_config.json, when ``ModelText.path`` is a directory), then encoders."""
    max_positions = max_positions or {}
    models = {}
    for m, t in texts.items():
        generation, eos = generation_of(t.path) if isinstance(t.path, str) and os.path.isdir(t.path) else (None, ())
        models[m] = ServedModel(m, t.path, ModelKind.GENERATION, text=t, max_positions=max_positions.get(m),
                                generation=generation, eos_token_ids=eos)
    for m, e in (encoders or {}).items():
        models[m] = ServedModel(m, e.path, e.kind, understanding=e)
    return models


class ServerState:
    def __init__(self, engine: EngineClient, models: Dict[str, ServedModel], settings: ServerSettings,
                 build: Optional[Callable[..., BuiltModel]] = None):
        """``build`` makes a model added while serving (default: ``building.build_model``)."""
        self.engine = engine
        repo = ModelRepository(settings.model_repository) if settings.model_repository else None
        self.registry = ModelRegistry(engine, models, build or build_model, repo, settings.request_timeout_s)
        self.settings = settings
        self.metrics = ServerMetrics(engine)
        self.fields = FieldPolicy(settings.strict_fields)
        """Unknown request fields: ignored and logged once, or refused (strict)."""
        self.draining = False
        self.started = time.time()
        self._keys = [k.encode() for k in settings.api_keys]
        self._arriving: Counter = Counter()
        """Per model: requests past ``refuse_early`` that have not reached the engine yet."""

    @property
    def models(self) -> Dict[str, ServedModel]:
        """The served models by id (the registry's, changed while serving)."""
        return self.registry.models

    def kind_of(self, model_id: Any) -> Optional[ModelKind]:
        """The kind of a served model; None for anything else (an unknown id, a non-string)."""
        m = self.models.get(model_id) if isinstance(model_id, str) else None
        return m.kind if m else None

    def model(self, model_id: str) -> ServedModel:
        """A served model, or 404 (``UnknownModelError``)."""
        m = self.models.get(model_id)
        if m is None:
            raise UnknownModelError(model_id, self.models)
        return m

    async def resolve(self, request: Request, model_id: Any) -> ServedModel:
        """The model an inference request names: a served one, or a repository model loaded now (the
        request waits for it; 503 while draining). ``ClientGone`` when the client leaves meanwhile (the
        load goes on); 404 for anything else."""
        m = self.models.get(model_id) if isinstance(model_id, str) else None
        if m is not None:
            return m
        if not self.registry.can_load(model_id):
            raise UnknownModelError(model_id, self.models)
        self.check_serving()
        return await unless_disconnected(request, self.registry.resolve(model_id))

    # ---- checks ----------------------------------------------------------------------------------
    def check_key(self, authorization: str) -> None:
        """401 unless ``authorization`` is ``Bearer <an accepted key>`` (or no key is configured)."""
        if not self._keys:
            return
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", "invalid_request_error",
                           None, "invalid_api_key")
        tok = token.strip().encode()
        if not any(hmac.compare_digest(tok, k) for k in self._keys):
            raise APIError(401, "incorrect API key provided", "invalid_request_error", None, "invalid_api_key")

    def check_serving(self) -> None:
        """503 while draining or once the engine is dead."""
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", None, "shutting_down")
        if not self.engine.is_alive:
            raise EngineDeadError(self.engine.dead_reason or "engine is dead")

    def refuse_early(self, call: "Call", model_id: Any) -> None:
        """Right after a request's model id is read: 503 while draining or dead, and the engine's refusal
        (``QueueFullError``: 429 with ``Retry-After``) when the model's queue is full or the request would
        be late, before the body is parsed further or its prompt tokenized. The requests this check let
        through that have not reached the engine yet (``call.arrived``) count as waiting: under a burst the
        routes of many requests pass here before the first of them queues. Nothing for an id not served
        (yet): the request's own checks answer it."""
        if isinstance(model_id, str) and model_id in self.models:
            self.check_serving()
            self.engine.check_admission(model_id, self._arriving[model_id])
            self._arriving[model_id] += 1
            call.arrival = (self._arriving, model_id)

    def admit(self, model: ServedModel) -> None:
        """``check_serving``. (A full queue is the engine's to refuse: ``ModelConfig.queue_size`` carries
        the config's per-model bound, and its QueueFullError answers 429.)"""
        self.check_serving()

    async def submit_rows(self, request: Request, model_id: str, rows: List[Dict[str, Any]]) -> List[Any]:
        """One engine request per row, all in flight together (the batch manager batches them); a failure
        or a client that goes away cancels the rest. The engine validates each row as it is submitted: a
        ``PayloadError`` carries the index of its row."""
        timeout = self.settings.request_timeout_s

        async def one(i: int, row: Dict[str, Any]) -> Any:
            try:
                return await self.engine.submit(model_id, row, timeout=timeout)
            except PayloadError as exc:  # the engine checked the row: say which one it was
                exc.row = i
                raise

        async def all_rows():
            tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(rows)]
            try:
                return await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    if not t.done():
                        t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return await unless_disconnected(request, all_rows())


# ---- dependencies -----------------------------------------------------------------------------------

# async, though they never wait: FastAPI runs a plain function dependency on a worker thread, two thread
# hops per request (0.1-0.5 ms each on a busy 2-core machine, before the request reaches the engine)

async def served_state(request: Request) -> ServerState:
    """The app's ``ServerState`` (a FastAPI dependency)."""
    return request.app.state.computron


def api_key(endpoint: Optional[str] = None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency: 401 unless the request bears an accepted key. With ``endpoint``, an
    inference route's 401 counts in ``computron_requests`` (model ``_unknown``)."""
    async def check(request: Request) -> None:
        state = request.app.state.computron
        try:
            state.check_key(request.headers.get("authorization", ""))
        except APIError:
            if endpoint:
                state.metrics.request_done(UNKNOWN, endpoint, 401)
            raise
    return check


class Call:
    """One inference request as the metrics and the debug log see it: endpoint, model label, start."""

    def __init__(self, state: ServerState, endpoint: str):
        self.metrics = state.metrics
        self.endpoint = endpoint
        self.label = UNKNOWN
        """The request's model once it is known to be served (metrics labels stay bounded)."""
        self.t0 = time.perf_counter()
        self.arrival = None
        """(``ServerState._arriving``, model id) from ``refuse_early`` until the request reaches the engine."""

    def arrived(self) -> None:
        """The request reached the engine (or ended before): it no longer counts as arriving. Idempotent."""
        if self.arrival is not None:
            counts, model_id = self.arrival
            self.arrival = None
            counts[model_id] -= 1
            if counts[model_id] <= 0:
                del counts[model_id]

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def gone(self) -> Response:
        """The client went away: 499."""
        self.arrived()
        self.metrics.request_done(self.label, self.endpoint, 499)
        log.debug("%s %s: client disconnected after %.1f ms", self.endpoint, self.label, self.elapsed() * 1e3)
        return Response(status_code=499)

    def failed(self, err: Union[APIError, V2Error]) -> Response:
        self.arrived()
        self.metrics.request_done(self.label, self.endpoint, err.status)
        if err.status == 429:  # the master's time on a refusal, for clients and benchmarks to see
            err.headers = {**err.headers, "Server-Timing": f"admission;dur={self.elapsed() * 1e3:.3f}"}
        log.debug("%s %s: %d %s (%.1f ms)", self.endpoint, self.label, err.status, err.message,
                  self.elapsed() * 1e3)
        return error_response(err)

    def answered(self, what: str) -> float:
        """Count a 200 and log ``what`` was answered; returns the seconds since arrival."""
        self.arrived()
        e2e = self.elapsed()
        self.metrics.request_done(self.label, self.endpoint, 200)
        log.debug("%s %s: 200, %s, %.1f ms", self.endpoint, self.label, what, e2e * 1e3)
        return e2e
