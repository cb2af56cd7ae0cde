"""The OpenAI-compatible HTTP front (FastAPI): text in, text out, many models behind one engine.

Routes only call the engine's public API (``submit``, ``stream``, ``snapshot``,
``counters``, ``events``, ``is_alive``, ``shutdown``). The ``model`` field of a
request picks the model; the engine queues it and swaps models in as needed.

    POST /v1/completions        POST /v1/chat/completions      (stream: true -> server-sent events)
    GET  /v1/models             GET  /v1/models/{id}           GET /health        GET /metrics (Prometheus)
    GET  /                      the status page;  GET /api/status, GET /api/events?since=N feed it

Errors answer in OpenAI's shape, or v2's under /v2, FastAPI's own 404/405/422 included (``errors.py``).
With API keys set, /v1/* and /v2/models/* need one; /health, /metrics, the status page and its feeds, and
/v2, /v2/health/* do not.

Encoder and ViT models (``encoders``: classifiers, embeddings) answer the Open Inference Protocol
(KServe v2: ``GET /v2/models/{name}``, ``.../ready``, ``POST .../infer``; parsing in ``v2.py``) and, for
embedding models, ``POST /v1/embeddings``; the text-generation routes answer 400 for them.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from ..errors import EngineDeadError, QueueFullError, UnknownModelError
from .config import ServerSettings
from .errors import APIError, api_error, bad, dumps, install_handlers, json_response
from .metrics import CONTENT_TYPE, ServerMetrics
from .text import ModelText, TextStream
from . import v2

log = logging.getLogger("computron.server")

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")

# Fields accepted with their effect, and fields accepted only at their OpenAI default (no effect).
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "user", "n"}
_COMPLETION_FIELDS = _COMMON | {"prompt"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
_DEFAULT_ONLY = {
    "echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (0,),
    "frequency_penalty": (0,), "logit_bias": (None, {}), "best_of": (1,), "suffix": (None,), "tools": (None, []),
    "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,),
    "service_tier": (None, "auto", "default"), "store": (None, False), "metadata": (None, {}),
}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


# ---- request parsing -----------------------------------------------------------

def _number(body, name, lo, hi, lo_open=False):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v > hi or v < lo or (lo_open and v == lo):
        raise bad(name, f"{name}={v!r}: must be a number in {'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def _int(body, name, lo):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise bad(name, f"{name}={v!r}: must be an integer >= {lo}")
    return v


class Params:
    """What a completion or chat request asks for, checked."""
    __slots__ = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                 "include_usage")


def parse_common(body: Any, allowed: set) -> Params:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for k, v in body.items():
        if k in allowed:
            continue
        if k in _DEFAULT_ONLY:
            if v in _DEFAULT_ONLY[k]:
                continue
            raise bad(k, f"{k}={v!r} is not supported by this server")
        raise bad(k, f"unsupported field {k!r}")
    p = Params()
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model: a model id (string) is required")
    p.model = model
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("n", f"n={n!r}: only n=1 is supported")
    p.max_tokens = _int(body, "max_tokens", 1)
    if p.max_tokens is None and "max_completion_tokens" in allowed:
        p.max_tokens = _int(body, "max_completion_tokens", 1)
    t = _number(body, "temperature", 0, 2)
    p.temperature = 1.0 if t is None else t  # OpenAI's default: sampling at temperature 1
    p.top_p = _number(body, "top_p", 0, 1, lo_open=True)
    p.top_k = _int(body, "top_k", 0)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("seed", f"seed={seed!r}: must be an integer")
    p.seed = seed
    stop = body.get("stop")
    if stop is None:
        p.stop = []
    elif isinstance(stop, str):
        p.stop = [stop] if stop else []
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        p.stop = [s for s in stop if s]
    else:
        raise bad("stop", "stop: must be a string or a list of at most 4 strings")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", f"stream={stream!r}: must be true or false")
    p.stream = stream
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("stream_options", "stream_options: must be an object")
    p.include_usage = bool((so or {}).get("include_usage", False))
    return p


def _prompt_ids(text: ModelText, prompt: Any) -> List[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return text.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt", "prompt: one prompt per request (a batch of prompts is not supported)")
    raise bad("prompt", "prompt: must be a non-empty string or a list of token ids")


def _request_names(body: Any, chat: bool) -> Dict[str, str]:
    """The request's names of the engine's fields (``input_ids`` is the prompt or the messages), for the
    ``param`` of an error the engine raised."""
    names = {"input_ids": "messages" if chat else "prompt"}
    if chat and isinstance(body, dict) and body.get("max_tokens") is None and "max_completion_tokens" in body:
        names["max_tokens"] = "max_completion_tokens"
    return names


def _messages(messages: Any) -> List[Dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages: must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", f"messages[{i}]: must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content", f"messages[{i}].content: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"messages[{i}].content: must be a string")
        out.append({"role": m["role"], "content": content})
    return out


# ---- the app -------------------------------------------------------------------

class ServerState:
    def __init__(self, engine, texts: Dict[str, ModelText], settings: ServerSettings,
                 queue_sizes: Optional[Dict[str, int]] = None, max_positions: Optional[Dict[str, int]] = None,
                 encoders: Optional[Dict[str, "v2.UnderstandingModel"]] = None):
        self.engine = engine
        self.texts = texts
        self.encoders = encoders or {}
        self.paths = {**{m: t.path for m, t in texts.items()}, **{m: e.path for m, e in self.encoders.items()}}
        self.settings = settings
        self.queue_sizes = {m: q for m, q in (queue_sizes or {}).items() if q}
        self.max_positions = max_positions or {}
        self.metrics = ServerMetrics(engine)
        self.draining = False
        self.started = time.time()
        self._keys = [k.encode() for k in settings.api_keys]

    # -- checks --
    def check_auth(self, request: Request) -> None:
        if not self._keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", "invalid_request_error",
                           None, "invalid_api_key")
        tok = token.strip().encode()
        if not any(hmac.compare_digest(tok, k) for k in self._keys):
            raise APIError(401, "incorrect API key provided", "invalid_request_error", None, "invalid_api_key")

    def model_object(self, model: str, snap: Dict[str, Any]) -> Dict[str, Any]:
        """OpenAI's model object, with the engine's ``state`` and the checkpoint path as ``root``."""
        return {"id": model, "object": "model", "created": int(self.started), "owned_by": "computron",
                "state": _openai_state(snap.get(model, {})), "root": self.paths[model]}

    def check_serving(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", None, "shutting_down")
        if not self.engine.is_alive:
            raise EngineDeadError(self.engine.snapshot().get("dead_reason") or "engine is dead")

    def model_text(self, model: str) -> ModelText:
        text = self.texts.get(model)
        if text is None:
            enc = self.encoders.get(model)
            if enc is not None:
                hint = " and /v1/embeddings" if enc.kind == v2.EMBEDDING else ""
                raise APIError(400, f"model {model!r} is an encoder ({enc.kind}), not a text generator: use "
                                    f"/v2/models/{model}/infer{hint}", "invalid_request_error", "model",
                               "model_not_generative")
            raise UnknownModelError(model, self.paths)
        return text

    def check_queue(self, model: str) -> None:
        limit = self.queue_sizes.get(model)
        if limit:
            waiting = self.engine.snapshot()["models"][model]["waiting"]
            if waiting >= limit:
                raise QueueFullError(f"model {model!r} already has {waiting} waiting requests (queue_size={limit})")

    def engine_data(self, p: Params, prompt_ids: List[int], default_max: int) -> Dict[str, Any]:
        max_tokens = p.max_tokens
        if max_tokens is None:
            room = self.max_positions.get(p.model)
            max_tokens = default_max if room is None else max(1, min(default_max, room - len(prompt_ids)))
        data = {"input_ids": prompt_ids, "max_tokens": max_tokens, "temperature": p.temperature}
        if p.top_p is not None:
            data["top_p"] = p.top_p
        if p.top_k is not None:
            data["top_k"] = p.top_k
        if p.seed is not None:
            data["seed"] = p.seed
        return data


def _state_name(s: Dict[str, Any]) -> str:
    """The status page's name of a model's state: disk, host, loading, resident or offloading."""
    state = s.get("state")
    if state == "loaded":
        return "resident"
    if state in ("loading", "offloading"):
        return state
    return "disk" if s.get("tier") == "disk" else "host"


def _openai_state(s: Dict[str, Any]) -> str:
    return {"loaded": "resident", "loading": "loading"}.get(s.get("state"), "offloaded")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, aw):
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


async def read_json(request: Request, error=lambda msg: bad(None, msg)) -> Any:
    """The request's JSON body; ``error(message)`` makes the exception raised when it is not JSON."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise error(f"the request body is not valid JSON: {exc}") from None


def _sse(obj: Dict[str, Any]) -> bytes:
    return b"data: " + dumps(obj).encode() + b"\n\n"


def create_app(engine, texts: Dict[str, ModelText], settings: Optional[ServerSettings] = None,
               queue_sizes: Optional[Dict[str, int]] = None, max_positions: Optional[Dict[str, int]] = None,
               owns_engine: bool = False, encoders: Optional[Dict[str, "v2.UnderstandingModel"]] = None) -> FastAPI:
    """The FastAPI app serving ``engine``'s models; ``texts`` maps each causal LM's id to its tokenizer,
    ``encoders`` each encoder or ViT model's id to its ``v2.UnderstandingModel``.

    With ``owns_engine`` the app shuts the engine down when it stops (after uvicorn's graceful drain).
    """
    settings = settings or ServerSettings()
    state = ServerState(engine, texts, settings, queue_sizes, max_positions, encoders)
    encoders = state.encoders

    @asynccontextmanager
    async def lifespan(app):
        yield
        state.draining = True
        if owns_engine:
            log.info("stopping the engine and its workers")
            await engine.shutdown()
            log.info("engine stopped")

    app = FastAPI(title="computron", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.computron = state
    install_handlers(app)
    timeout = settings.request_timeout_s

    def finish_reason(ts: TextStream, last: Optional[int], n: int, max_tokens: int, text: ModelText) -> str:
        """'stop' for a stop string or an EOS (the engine ends a sequence short of max_tokens only at one of
        the model's EOS ids), else 'length'."""
        if ts.stopped or n < max_tokens or (last is not None and last == text.eos_token_id):
            return "stop"
        return "length"

    async def generate(request: Request, p: Params, text: ModelText, data: Dict[str, Any],
                       t0: float) -> Tuple[TextStream, Optional[int], float]:
        """The whole answer of a non-streamed request: (text stream, last token id, TTFT). Tokens are
        taken as the engine makes them, which times the first one and stops the sequence at a stop
        string."""
        ts = TextStream(text, data["input_ids"], p.stop)

        async def run():
            last, ttft = None, -1.0
            it = engine.stream(p.model, data, timeout=timeout)
            try:
                async for tok in it:
                    if last is None:
                        ttft = time.perf_counter() - t0
                    last = tok
                    ts.push(tok)
                    if ts.stopped:
                        break
            finally:
                await it.aclose()
            ts.finish()
            return ts, last, ttft
        return await _unless_disconnected(request, run())

    async def handle(request: Request, endpoint: str, chat: bool):
        t0 = time.perf_counter()
        model, body = "_unknown", None
        try:
            state.check_auth(request)
            body = await read_json(request)
            if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"] in texts:
                model = body["model"]  # the label of this request's metrics, whatever else is wrong with it
            p = parse_common(body, _CHAT_FIELDS if chat else _COMPLETION_FIELDS)
            text = state.model_text(p.model)
            if chat:
                prompt_ids = text.chat_ids(_messages(body.get("messages")))
            else:
                if "prompt" not in body:
                    raise bad("prompt", "prompt: required")
                prompt_ids = _prompt_ids(text, body["prompt"])
            state.check_serving()
            state.check_queue(model)
            data = state.engine_data(p, prompt_ids, settings.default_max_tokens if chat else 16)
            if p.stream:
                return await start_stream(request, endpoint, chat, p, text, data, t0)
            ts, last, ttft = await generate(request, p, text, data, t0)
        except ClientGone:
            state.metrics.request_done(model, endpoint, 499)
            log.debug("%s %s: client disconnected after %.1f ms", endpoint, model, (time.perf_counter() - t0) * 1e3)
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
            err = api_error(exc, _request_names(body, chat))
            state.metrics.request_done(model, endpoint, err.status)
            log.debug("%s %s: %d %s (%.1f ms)", endpoint, model, err.status, err.message,
                      (time.perf_counter() - t0) * 1e3)
            return err.response()
        e2e = time.perf_counter() - t0
        n_prompt, n_out = len(prompt_ids), ts.n_tokens
        reason = finish_reason(ts, last, n_out, data["max_tokens"], text)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if chat:
            out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": ts.text},
                                "logprobs": None, "finish_reason": reason}], "usage": usage}
        else:
            out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                   "choices": [{"index": 0, "text": ts.text, "logprobs": None, "finish_reason": reason}],
                   "usage": usage}
        m = state.metrics
        m.request_done(model, endpoint, 200)
        m.tokens(model, n_prompt, n_out)
        m.latency(model, ttft, e2e, n_out)
        log.debug("%s %s: 200, %d+%d tokens, %.1f ms", endpoint, model, n_prompt, n_out, e2e * 1e3)
        return json_response(out)

    async def start_stream(request: Request, endpoint: str, chat: bool, p: Params, text: ModelText,
                           data: Dict[str, Any], t0: float):
        """Wait for the first token (so errors before it get their status code), then stream the rest."""
        it = engine.stream(p.model, data, timeout=timeout)
        try:
            first = await _unless_disconnected(request, it.__anext__())
        except BaseException:
            await it.aclose()
            raise
        ttft = time.perf_counter() - t0
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = p.model
        if chat:
            def chunk(piece: Optional[str], reason: Optional[str] = None, role: bool = False):
                delta = {"role": "assistant", "content": ""} if role else ({"content": piece} if piece else {})
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
            obj_name = "chat.completion.chunk"
        else:
            def chunk(piece: Optional[str], reason: Optional[str] = None, role: bool = False):
                return {"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": 0, "text": piece or "", "logprobs": None, "finish_reason": reason}]}
            obj_name = "text_completion"

        async def events() -> AsyncIterator[bytes]:
            ts = TextStream(text, data["input_ids"], p.stop)
            status, last = 499, first
            try:
                if chat:
                    yield _sse(chunk(None, role=True))
                piece = ts.push(first)
                if piece:
                    yield _sse(chunk(piece))
                if not ts.stopped:
                    async for tok in it:
                        last = tok
                        piece = ts.push(tok)
                        if piece:
                            yield _sse(chunk(piece))
                        if ts.stopped:
                            break
                piece = ts.finish()
                if piece:
                    yield _sse(chunk(piece))
                yield _sse(chunk(None, finish_reason(ts, last, ts.n_tokens, data["max_tokens"], text)))
                n_prompt = len(data["input_ids"])
                if p.include_usage:
                    yield _sse({"id": rid, "object": obj_name, "created": created, "model": model, "choices": [],
                                "usage": {"prompt_tokens": n_prompt, "completion_tokens": ts.n_tokens,
                                          "total_tokens": n_prompt + ts.n_tokens}})
                yield b"data: [DONE]\n\n"
                status = 200
                e2e = time.perf_counter() - t0
                state.metrics.tokens(model, n_prompt, ts.n_tokens)
                state.metrics.latency(model, ttft, e2e, ts.n_tokens)
            except (asyncio.CancelledError, GeneratorExit):
                raise  # the client went away (or the server is stopping): aclose() below cancels the sequence
            except Exception as exc:  # noqa: BLE001 - the engine failed mid-stream: end with an error event
                err = api_error(exc)
                status = err.status
                yield _sse(err.body())
                yield b"data: [DONE]\n\n"
            finally:
                with anyio.CancelScope(shield=True):  # starlette cancels its task group on disconnect
                    await it.aclose()
                state.metrics.request_done(model, endpoint, status)
                log.debug("%s %s (stream): %d, %d tokens, %.1f ms", endpoint, model, status, ts.n_tokens,
                          (time.perf_counter() - t0) * 1e3)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat", chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            state.check_auth(request)
        except APIError as err:
            return err.response()
        snap = engine.snapshot()["models"]
        return json_response({"object": "list", "data": [state.model_object(m, snap) for m in state.paths]})

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str, request: Request):
        try:
            state.check_auth(request)
            if model_id not in state.paths:
                raise UnknownModelError(model_id, state.paths)
        except Exception as exc:  # noqa: BLE001 - 401 or 404 in OpenAI's shape
            return api_error(exc).response()
        return json_response(state.model_object(model_id, engine.snapshot()["models"]))

    @app.get("/health")
    async def health():
        if state.draining:
            return json_response({"status": "shutting_down"}, 503)
        if not engine.is_alive:
            reason = engine.snapshot().get("dead_reason")
            return json_response({"status": "dead", "reason": reason}, 503)
        return json_response({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/")
    async def index():
        return FileResponse(os.path.join(STATIC_DIR, "index.html"), media_type="text/html")

    @app.get("/api/status")
    async def status():
        snap = engine.snapshot()
        models = []
        for m in state.paths:
            s = snap["models"].get(m, {})
            models.append({"id": m, "state": _state_name(s), "engine_state": s.get("state"), "tier": s.get("tier"),
                           "waiting": s.get("waiting", 0), "running": s.get("running", 0),
                           "last_load": s.get("last_load"), "last_offload": s.get("last_offload")})
        return json_response({"alive": snap.get("alive", engine.is_alive), "dead_reason": snap.get("dead_reason"),
                              "draining": state.draining, "time": time.time(), "models": models})

    @app.get("/api/events")
    async def events(since: int = 0):
        cursor, evs = engine.events(since)
        return json_response({"next": cursor, "events": evs})

    v2_routes(app, state, timeout)
    return app


def v2_routes(app: FastAPI, state: ServerState, timeout: float) -> None:
    """The Open Inference Protocol (KServe v2 REST) for encoder and ViT models, and OpenAI's /v1/embeddings.
    Causal LMs are not v2 models here: /v2/models/{name} answers 404 for them (they live under /v1)."""
    engine, encoders = state.engine, state.encoders

    def v2_fail(exc: BaseException) -> Response:
        err = v2.v2_error(exc) or api_error(exc)  # the v2 wording of engine errors, else the OpenAI one's
        return json_response({"error": err.message}, err.status, err.headers)

    def v2_model(name: str) -> "v2.UnderstandingModel":
        m = encoders.get(name)
        if m is None:
            if name in state.texts:
                raise v2.V2Error(404, f"model {name!r} is a text-generation model, served under /v1 only; "
                                      f"v2 models: {sorted(encoders)}")
            raise v2.V2Error(404, f"unknown model {name!r}; v2 models: {sorted(encoders)}")
        return m

    @app.get("/v2")
    async def v2_server_metadata():
        return json_response({"name": "computron", "version": "1", "extensions": []})

    @app.get("/v2/health/live")
    async def v2_live():
        return json_response({"live": True})

    @app.get("/v2/health/ready")
    async def v2_ready():
        ok = engine.is_alive and not state.draining
        return json_response({"ready": ok}, 200 if ok else 503)

    @app.get("/v2/models/{name:path}/ready")
    async def v2_model_ready(name: str, request: Request):
        try:
            state.check_auth(request)
            v2_model(name)
            state.check_serving()
        except Exception as exc:  # noqa: BLE001
            return v2_fail(exc)
        return json_response({"name": name, "ready": True})

    @app.get("/v2/models/{name:path}")  # registered second: the versions route must match first
    @app.get("/v2/models/{name:path}/versions/{version}")
    async def v2_metadata(name: str, request: Request, version: Optional[str] = None):
        try:
            state.check_auth(request)
            m = v2_model(name)
            if version not in (None, "1"):
                raise v2.V2Error(404, f"model {name!r} has no version {version!r}; versions: ['1']")
        except Exception as exc:  # noqa: BLE001
            return v2_fail(exc)
        return json_response(m.metadata())

    async def submit_all(request: Request, model: str, rows: List[Dict[str, Any]]) -> List[Any]:
        """One engine request per row, all in flight together (the batch manager batches them); a failure
        or a client that goes away cancels the rest."""
        async def all_rows():
            tasks = [asyncio.ensure_future(engine.submit(model, r, timeout=timeout)) for r in rows]
            try:
                return await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    if not t.done():
                        t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return await _unless_disconnected(request, all_rows())

    @app.post("/v2/models/{name:path}/infer")
    @app.post("/v2/models/{name:path}/versions/{version}/infer")
    async def v2_infer(name: str, request: Request, version: Optional[str] = None):
        t0 = time.perf_counter()
        label = name if name in encoders else "_unknown"
        try:
            state.check_auth(request)
            m = v2_model(name)
            if version not in (None, "1"):
                raise v2.V2Error(404, f"model {name!r} has no version {version!r}; versions: ['1']")
            body = await read_json(request, lambda msg: v2.V2Error(400, msg))
            rows, want, rid = v2.parse_infer(m, body)
            v2.check_rows(m, rows, ("text", "input_ids", "pixel_values", "image"))
            state.check_serving()
            state.check_queue(name)
            answers = await submit_all(request, name, rows)
            out = v2.encode_outputs(m, answers, want, rid)
        except ClientGone:
            state.metrics.request_done(label, "v2_infer", 499)
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - every failure answers in the v2 shape
            resp = v2_fail(exc)
            state.metrics.request_done(label, "v2_infer", resp.status_code)
            log.debug("v2 infer %s: %d (%.1f ms)", name, resp.status_code, (time.perf_counter() - t0) * 1e3)
            return resp
        e2e = time.perf_counter() - t0
        state.metrics.request_done(label, "v2_infer", 200)
        state.metrics.e2e.labels(label).observe(e2e)
        log.debug("v2 infer %s: 200, %d rows, %.1f ms", name, len(rows), e2e * 1e3)
        return json_response(out)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        t0 = time.perf_counter()
        label = "_unknown"
        try:
            state.check_auth(request)
            body = await read_json(request)
            if not isinstance(body, dict):
                raise bad(None, "the request body must be a JSON object")
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise bad("model", "model: a model id (string) is required")
            m = encoders.get(model)
            if m is None:
                if model in state.texts:
                    raise bad("model", f"model {model!r} is a text-generation model and serves no embeddings")
                raise UnknownModelError(model, state.paths)
            label = model
            if m.kind != v2.EMBEDDING:
                raise bad("model", f"model {model!r} is a {m.kind} model and serves no embeddings (serve its "
                                    f"checkpoint with task: embedding); use /v2/models/{model}/infer")
            try:
                rows, counts, fmt = v2.parse_embeddings(m, body)
            except ValueError as exc:
                param, msg = exc.args
                raise bad(param, msg) from None
            state.check_serving()
            state.check_queue(model)
            answers = await submit_all(request, model, rows)
        except ClientGone:
            state.metrics.request_done(label, "embeddings", 499)
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
            err = api_error(exc, {"input_ids": "input", "text": "input"})
            state.metrics.request_done(label, "embeddings", err.status)
            return err.response()
        e2e = time.perf_counter() - t0
        n = sum(counts)
        state.metrics.request_done(label, "embeddings", 200)
        state.metrics.prompt_tokens.labels(label).inc(n)
        state.metrics.e2e.labels(label).observe(e2e)
        out = {"object": "list", "data": v2.embedding_data([a["embedding"] for a in answers], fmt),
               "model": model, "usage": {"prompt_tokens": n, "total_tokens": n}}
        return json_response(out)
