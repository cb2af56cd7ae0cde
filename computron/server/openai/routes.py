"""OpenAI's routes: the ``/v1`` router.

    POST /v1/completions        POST /v1/chat/completions      (stream: true -> server-sent events)
    GET  /v1/models             GET  /v1/models/{id}           POST /v1/embeddings (embedding models)

Every route needs the API key when keys are set (the ``api_key`` dependency). A completion goes:
body -> ``CompletionParams`` -> the model's tokenizer -> ``ServerState.admit`` -> the engine, and is
answered by a ``Completion``: whole (``generate``), or streamed (``stream``: the first token is awaited
before the answer starts, so errors before it get their status code; an error after it ends the stream
with an error event, then ``data: [DONE]``). Encoder models answer 400 here, except embedding models
at ``/v1/embeddings``. A request naming a model of ``--model-repository`` that is not loaded yet waits
while it loads (``ServerState.resolve``); ``/v1/models`` lists such models too, with ``state``
``unloaded`` (``loading`` while its first request waits). A LoRA adapter (``lora_routes.py``, YAML
entries with ``base``) is served like a model: its requests use its base's tokenizer, and its model
object has ``parent`` (its base's id; None for models) and ``root`` (its directory), as vLLM's do.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Dict, Iterable, Optional

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..errors import APIError, ClientGone, bad, to_openai
from ..http import SSE_DONE, json_response, read_json, sse, sse_response, unless_disconnected
from ..model_kind import ModelKind
from ..residency import Residency
from ..state import Call, ServedModel, ServerState, api_key, served_state
from ..text import ModelText, TextStream
from .protocol import (Answer, CompletionParams, embedding_data, engine_field_names, engine_request, model_field,
                       parse_chat, parse_completion, parse_embeddings, prompt_ids, usage)

log = logging.getLogger("computron.server")

router = APIRouter()


class Completion:
    """One completion or chat completion, from the engine's tokens to its answer."""

    def __init__(self, state: ServerState, request: Request, call: Call, p: CompletionParams, text: ModelText,
                 data: Dict[str, Any], eos: Iterable[int] = ()):
        self.state, self.request, self.call = state, request, call
        self.p, self.text, self.data = p, text, data
        """The checked request, the model's tokenizer, and the engine's request."""
        self.eos = set(eos) | ({text.eos_token_id} if text.eos_token_id is not None else set())
        """The model's EOS ids (config.json's, generation_config.json's, the tokenizer's)."""

    def _tokens(self) -> AsyncIterator[int]:
        return self.state.engine.stream(self.p.model, self.data, timeout=self.state.settings.request_timeout_s)

    def finish_reason(self, ts: TextStream, last: Optional[int]) -> str:
        """'stop' for a stop string or an EOS (the engine ends a sequence short of max_tokens only at one of
        the model's EOS ids), else 'length'."""
        if ts.stopped or ts.n_tokens < self.data["max_tokens"] or last in self.eos:
            return "stop"
        return "length"

    def _done(self, ts: TextStream, ttft: float) -> None:
        n_prompt = len(self.data["input_ids"])
        e2e = self.call.answered(f"{n_prompt}+{ts.n_tokens} tokens")
        self.state.metrics.tokens(self.call.label, n_prompt, ts.n_tokens)
        self.state.metrics.latency(self.call.label, ttft, e2e, ts.n_tokens)

    async def generate(self) -> Response:
        """The whole answer. Tokens are taken as the engine makes them, which times the first one and stops
        the sequence at a stop string."""
        ts = TextStream(self.text, self.data["input_ids"], self.p.stop)
        last, ttft = await unless_disconnected(self.request, self._take(ts))
        n_prompt = len(self.data["input_ids"])
        body = Answer(self.p).whole(ts.text, self.finish_reason(ts, last), usage(n_prompt, ts.n_tokens))
        self._done(ts, ttft)
        return json_response(body)

    async def _take(self, ts: TextStream):
        last, ttft = None, -1.0
        it = self._tokens()
        try:
            async for tok in it:
                if last is None:
                    ttft = self.call.elapsed()
                last = tok
                ts.push(tok)
                if ts.stopped:
                    break
        finally:
            await it.aclose()
        ts.finish()
        return last, ttft

    async def stream(self) -> Response:
        """Wait for the first token (so errors before it get their status code), then stream the rest."""
        it = self._tokens()
        try:
            first = await unless_disconnected(self.request, it.__anext__())
        except BaseException:  # a disconnect or cancellation too: the generation is closed; re-raised
            await it.aclose()
            raise
        return sse_response(self._events(it, first, self.call.elapsed()))

    async def _events(self, it: AsyncIterator[int], first: int, ttft: float) -> AsyncIterator[bytes]:
        answer, ts = Answer(self.p), TextStream(self.text, self.data["input_ids"], self.p.stop)
        status, last = 499, first
        try:
            if self.p.chat:
                yield sse(answer.chunk(None, role=True))
            piece = ts.push(first)
            if piece:
                yield sse(answer.chunk(piece))
            if not ts.stopped:
                async for tok in it:
                    last = tok
                    piece = ts.push(tok)
                    if piece:
                        yield sse(answer.chunk(piece))
                    if ts.stopped:
                        break
            piece = ts.finish()
            if piece:
                yield sse(answer.chunk(piece))
            yield sse(answer.chunk(None, self.finish_reason(ts, last)))
            if self.p.include_usage:
                yield sse(answer.usage_chunk(usage(len(self.data["input_ids"]), ts.n_tokens)))
            yield SSE_DONE
            status = 200
            self._done(ts, ttft)
        except (asyncio.CancelledError, GeneratorExit):
            raise  # the client went away (or the server is stopping): aclose() below cancels the sequence
        except Exception as exc:  # noqa: BLE001 - the engine failed mid-stream: end with an error event
            err = to_openai(exc)
            status = err.status
            yield sse(err.body())
            yield SSE_DONE
        finally:
            with anyio.CancelScope(shield=True):  # starlette cancels its task group on disconnect
                await it.aclose()
            if status != 200:
                self.state.metrics.request_done(self.call.label, self.call.endpoint, status)
                log.debug("%s %s (stream): %d after %d tokens", self.call.endpoint, self.call.label, status,
                          ts.n_tokens)


async def _generator(state: ServerState, request: Request, model_id: str) -> ServedModel:
    """A text-generation model (loaded first when it is a repository model's first request), 400 for an
    encoder (naming where it is served), 404 for an unknown id."""
    m = await state.resolve(request, model_id)
    if m.kind is not ModelKind.GENERATION:
        hint = " and /v1/embeddings" if m.kind is ModelKind.EMBEDDING else ""
        raise APIError(400, f"model {model_id!r} is an encoder ({m.kind}), not a text generator: use "
                            f"/v2/models/{model_id}/infer{hint}", "invalid_request_error", "model",
                       "model_not_generative")
    return m


async def _complete(request: Request, state: ServerState, endpoint: str, chat: bool) -> Response:
    call, body = Call(state, endpoint), None
    try:
        body = await read_json(request)
        model_id = body.get("model") if isinstance(body, dict) else None
        if state.kind_of(model_id) is ModelKind.GENERATION:
            call.label = model_id  # the label of this request's metrics, whatever else is wrong with it
        p = parse_chat(body) if chat else parse_completion(body)
        served = await _generator(state, request, p.model)
        call.label = served.id
        ids = prompt_ids(served.text, p)
        state.admit(served)
        data = engine_request(p, ids, state.settings.default_max_tokens if chat else 16, served.max_positions,
                              served.generation)
        completion = Completion(state, request, call, p, served.text, data, served.eos_token_ids)
        return await (completion.stream() if p.stream else completion.generate())
    except ClientGone:
        return call.gone()
    except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
        return call.failed(to_openai(exc, engine_field_names(body, chat)))


@router.post("/v1/completions", dependencies=[Depends(api_key("completions"))])
async def completions(request: Request, state: ServerState = Depends(served_state)):
    return await _complete(request, state, "completions", chat=False)


@router.post("/v1/chat/completions", dependencies=[Depends(api_key("chat"))])
async def chat_completions(request: Request, state: ServerState = Depends(served_state)):
    return await _complete(request, state, "chat", chat=True)


UNLOADED = "unloaded"
"""The ``state`` of a ``--model-repository`` model no request has loaded yet."""


def _model_object(state: ServerState, model_id: str, path: str, snap) -> Dict[str, Any]:
    """OpenAI's model object, with the model's ``state`` (an adapter's is its base's), its checkpoint or
    adapter directory as ``root``, and an adapter's base as ``parent``."""
    served = state.models.get(model_id)
    if served is not None:
        where = Residency.of(snap.models.get(model_id)).openai_state
    else:
        where = Residency.LOADING.openai_state if state.registry.loading(model_id) else UNLOADED
    return {"id": model_id, "object": "model", "created": int(state.started), "owned_by": "computron",
            "state": where, "root": path, "parent": served.base if served else None}


@router.get("/v1/models", dependencies=[Depends(api_key())])
async def models(state: ServerState = Depends(served_state)):
    snap = state.engine.snapshot()
    listed = {**{m.id: m.path for m in state.models.values()}, **state.registry.unloaded()}
    return json_response({"object": "list", "data": [_model_object(state, m, p, snap) for m, p in listed.items()]})


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(api_key())])
async def model_info(model_id: str, state: ServerState = Depends(served_state)):
    path = state.registry.unloaded().get(model_id) or state.model(model_id).path
    return json_response(_model_object(state, model_id, path, state.engine.snapshot()))


@router.post("/v1/embeddings", dependencies=[Depends(api_key("embeddings"))])
async def embeddings(request: Request, state: ServerState = Depends(served_state)):
    call = Call(state, "embeddings")
    try:
        body = await read_json(request)
        model_id = model_field(body)
        m = await state.resolve(request, model_id)
        if m.kind is ModelKind.GENERATION:
            raise bad("model", f"model {model_id!r} is a text-generation model and serves no embeddings")
        call.label = model_id
        if m.kind is not ModelKind.EMBEDDING:
            raise bad("model", f"model {model_id!r} is a {m.kind} model and serves no embeddings (serve its "
                               f"checkpoint with task: embedding); use /v2/models/{model_id}/infer")
        rows, fmt = parse_embeddings(m.understanding, body)
        state.admit(m)
        answers = await state.submit_rows(request, model_id, rows)
    except ClientGone:
        return call.gone()
    except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
        return call.failed(to_openai(exc, {"input_ids": "input", "text": "input", None: "input"}))
    n = sum(a["tokens"] for a in answers)
    e2e = call.answered(f"{len(rows)} inputs")
    state.metrics.prompt_tokens(model_id, n)
    state.metrics.observe_e2e(model_id, e2e)
    return json_response({"object": "list", "data": embedding_data([a["embedding"] for a in answers], fmt),
                          "model": model_id, "usage": {"prompt_tokens": n, "total_tokens": n}})
