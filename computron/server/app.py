"""The HTTP front (FastAPI): many models behind one engine, OpenAI's protocol and KServe v2.

``create_app`` builds the ``ServerState`` and mounts its routers over it:

    openai/routes.py   POST /v1/completions, /v1/chat/completions, /v1/embeddings; GET /v1/models[/{id}]
    openai/responses_routes.py, openai/tokenize_routes.py   POST /v1/responses; POST /tokenize, /detokenize
    openai/lora_routes.py  vLLM's POST /v1/load_lora_adapter, /v1/unload_lora_adapter (LoRA adapters)
    v2/routes.py       the Open Inference Protocol for encoder and ViT models (/v2, /v2/models/{name}/...)
    v2/repository.py   Triton's model repository API: POST /v2/repository/index, .../models/{name}/load, unload
    status.py          GET / (status page), /api/status, /api/events, /health, /metrics

Beside them: ``state.py`` (admission, the API-key dependency), ``registry.py`` (the served models,
changed while serving), ``building.py`` (one model from its config entry, at start-up and later),
``repository.py`` (``--model-repository``),
``errors.py`` (one table from engine errors to OpenAI's and v2's shapes), ``http.py`` (JSON, SSE,
disconnects), the request shapes in ``openai/`` (``protocol.py``, ``chat.py``, ...) and ``v2/protocol.py``,
``metrics.py``
(Prometheus), ``residency.py`` and ``model_kind.py`` (the two vocabularies), ``text.py`` (tokenizers,
detokenizing, stop strings), ``engine/protocol.py`` (what the server uses of the engine), and
``config.py`` and ``cli.py`` (``computron serve``). The ``model`` field of a request picks the model;
the engine queues it and swaps models in as needed.

Errors answer in OpenAI's shape, or v2's under /v2, FastAPI's own 404/405/422 included (the handlers
below). With API keys set, /v1/*, /v2/models/* and /v2/repository/* need one; /health, /metrics, the
status page and its feeds, and /v2, /v2/health/* do not.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Callable, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.protocol import EngineClient
from ..errors import ComputronError
from . import ps, status
from .building import BuiltModel, ServedModel
from .building import UnderstandingModel
from .config import ServerSettings
from .errors import ERROR_TABLE, APIError, V2Error, bad, to_openai, to_v2
from .http import error_response
from .openai import lora_routes
from .openai import responses_routes, tokenize_routes
from .openai import routes as openai_routes
from .state import ServerState, served_models
from .text import ModelText
from .v2 import repository as v2_repository
from .v2 import routes as v2_routes

log = logging.getLogger("computron.server")


def create_app(engine: EngineClient, texts: Optional[Dict[str, ModelText]] = None,
               settings: Optional[ServerSettings] = None, max_positions: Optional[Dict[str, int]] = None,
               owns_engine: bool = False, encoders: Optional[Dict[str, UnderstandingModel]] = None, *,
               models: Optional[Dict[str, ServedModel]] = None,
               build: Optional[Callable[..., BuiltModel]] = None) -> FastAPI:
    """The FastAPI app serving ``engine``'s models: ``models`` (``building.build_model``'s, as ``computron
    serve`` passes them), or ready-made parts: ``texts`` maps each causal LM's id to its tokenizer,
    ``encoders`` each encoder or ViT model's id to its ``UnderstandingModel``; ``max_positions`` is per
    model. (Per-model queue bounds are the engine's: ``ModelConfig.queue_size``.) ``build`` makes the
    models added while serving (default: ``building.build_model``).

    With ``owns_engine`` the app shuts the engine down when it stops (after uvicorn's graceful drain).
    The lifespan scans ``settings.model_repository`` at start-up and runs its poll.
    """
    settings = settings or ServerSettings()
    served = dict(models) if models is not None else served_models(texts or {}, encoders, max_positions)
    state = ServerState(engine, served, settings, build)

    @asynccontextmanager
    async def lifespan(app):
        await state.registry.start(settings.repository_poll_s)
        yield
        state.draining = True
        await state.registry.stop()
        if owns_engine:
            log.info("stopping the engine and its workers")
            await engine.shutdown()
            log.info("engine stopped")

    app = FastAPI(title="computron", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.computron = state
    for router in (openai_routes.router, responses_routes.router, tokenize_routes.router, lora_routes.router,
                   status.router, ps.router, v2_routes.router, v2_repository.router):
        app.include_router(router)
    _install_error_handlers(app)
    return app


def _is_v2(request: Request) -> bool:
    path = request.url.path
    return path == "/v2" or path.startswith("/v2/")


def _install_error_handlers(app: FastAPI) -> None:
    """Answer what a route raises, and FastAPI's own errors (unknown route, wrong method, invalid
    parameters, uncaught), in the shape of the route asked for: v2's under /v2, OpenAI's elsewhere."""

    async def shaped(request: Request, exc: Exception):
        return error_response(to_v2(exc) if _is_v2(request) else to_openai(exc))

    # every type of the error table by name: Starlette's catch-all (Exception) answers, then re-raises
    for exc_type in (APIError, V2Error, ComputronError, *(cls for cls, _ in ERROR_TABLE), Exception):
        app.add_exception_handler(exc_type, shaped)

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException):
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            err = APIError(404, f"Invalid URL ({where}): no such route", "invalid_request_error", None, "not_found")
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            err = APIError(405, f"Method not allowed ({where}); allowed: {allowed}", "invalid_request_error",
                           None, "method_not_allowed", exc.headers)
        else:
            err = APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, None, exc.headers)
        return await shaped(request, err)

    @app.exception_handler(RequestValidationError)
    async def validation_exception(request: Request, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path", "header")]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        return await shaped(request, bad(param, f"{param}: {msg}" if param else msg))
