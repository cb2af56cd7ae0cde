"""OpenAI's routes: the ``/v1`` router.

    POST /v1/completions        POST /v1/chat/completions      (stream: true -> server-sent events)
    GET  /v1/models             GET  /v1/models/{id}           POST /v1/embeddings (embedding models)

(``/v1/responses`` is ``responses_routes.py``'s, ``/tokenize`` and ``/detokenize`` ``tokenize_routes.py``'s.)
Every route needs the API key when keys are set (the ``api_key`` dependency). A completion goes: body ->
``CompletionParams`` (``protocol.py``; chat's messages and tools: ``chat.py``) -> the model's tokenizer ->
``ServerState.admit`` -> one engine request per choice (``n`` per prompt, each prompt of a batch) ->
``Generation`` (``runner.py``) -> ``Answer`` (``answer.py``): whole, or streamed (every choice's first
token is awaited before the answer starts, so errors before it get their status code; an error after it
ends the stream with an error event, then ``data: [DONE]``). Unknown fields are the ``FieldPolicy``'s
(ignored and logged once, or 400 in strict mode). Encoder models answer 400 here, except embedding models
at ``/v1/embeddings``. A request naming a model of ``--model-repository`` that is not loaded yet waits
while it loads (``ServerState.resolve``); ``/v1/models`` lists such models too (``model_info.py``).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Dict, List

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..errors import APIError, ClientGone, bad, to_openai
from ..http import SSE_DONE, json_response, read_json, sse, sse_response
from ..model_kind import ModelKind
from ..state import Call, ServedModel, ServerState, api_key, served_state
from .answer import Answer
from .chat import ChatTools, chat_messages, parse_tools, template_kwargs
from .choices import ChoiceRun
from .embeddings import EMBEDDING_FIELDS, embedding_data, parse_embeddings
from .fields import keep_alive_of, model_field
from .model_info import UNLOADED, model_object, strict_fields, tool_parser
from .protocol import (CHAT_FIELDS, COMPLETION_FIELDS, CompletionParams, choice_requests, engine_field_names,
                       engine_request, parse_chat, parse_completion, prompt_ids, prompts, usage)
from .runner import Generation

log = logging.getLogger("computron.server")

router = APIRouter()

__all__ = ["router", "UNLOADED", "generator_model", "chat_prompt_ids", "runs_of", "sse_stream"]


async def generator_model(state: ServerState, request: Request, model_id: str) -> ServedModel:
    """A text-generation model (loaded first when it is a repository model's first request), 400 for an
    encoder (naming where it is served), 404 for an unknown id."""
    m = await state.resolve(request, model_id)
    if m.kind is not ModelKind.GENERATION:
        hint = " and /v1/embeddings" if m.kind is ModelKind.EMBEDDING else ""
        raise APIError(400, f"model {model_id!r} is an encoder ({m.kind}), not a text generator: use "
                            f"/v2/models/{model_id}/infer{hint}", "invalid_request_error", "model",
                       "model_not_generative")
    return m


def chat_prompt_ids(served: ServedModel, messages: List[Dict[str, Any]], tools: ChatTools,
                    kwargs: Dict[str, Any]) -> List[int]:
    return served.text.chat_ids(messages, tools.template_tools(), kwargs)


def runs_of(p: CompletionParams, served: ServedModel, all_ids: List[List[int]], default_max: int,
            echoes: List[Any]) -> List[ChoiceRun]:
    """The choices of a request: ``n`` per prompt, indexed ``prompt * n + i`` (OpenAI's order)."""
    runs = []
    for pi, ids in enumerate(all_ids):
        data = engine_request(p, ids, default_max, served.max_positions, served.generation)
        for i, d in enumerate(choice_requests(data, p.n)):
            runs.append(ChoiceRun(pi * p.n + i, served.text, d, p.stop, served.eos_token_ids, echo=echoes[pi],
                                  discard=p.max_tokens == 0, want_logprobs=p.logprobs is not None))
    return runs


async def sse_stream(gen: Generation, events: AsyncIterator[bytes], label: str) -> AsyncIterator[bytes]:
    """An OpenAI event stream over ``events``: ``data: [DONE]`` last; an error mid-stream as an error event;
    every sequence closed however it ends, a failure counted."""
    status = 499
    try:
        async for e in events:
            yield e
        yield SSE_DONE
        status = 200
    except (asyncio.CancelledError, GeneratorExit):
        raise  # the client went away (or the server is stopping): close() below cancels the sequences
    except Exception as exc:  # noqa: BLE001 - the engine failed mid-stream: end with an error event
        err = to_openai(exc)
        status = err.status
        yield sse(err.body())
        yield SSE_DONE
    finally:
        with anyio.CancelScope(shield=True):  # starlette cancels its task group on disconnect
            await gen.close()
        if status != 200:
            gen.state.metrics.request_done(gen.call.label, gen.call.endpoint, status)
            log.debug("%s %s (stream): %d", gen.call.endpoint, label, status)


async def _chunks(gen: Generation, answer: Answer, p: CompletionParams) -> AsyncIterator[bytes]:
    for run in gen.runs:
        for c in answer.start(run):
            yield sse(c)
    async for run, kind, piece in gen.events():
        for c in (answer.end(run, piece) if kind == "end" else answer.piece(run, piece)):
            yield sse(c)
    n_prompt, n_gen = gen.counts(p.n)
    if p.include_usage:
        yield sse(answer.usage_chunk(usage(n_prompt, n_gen)))
    gen.done(p.n)


async def _complete(request: Request, state: ServerState, endpoint: str, chat: bool) -> Response:
    call, body = Call(state, endpoint), None
    try:
        body = await read_json(request)
        model_id = body.get("model") if isinstance(body, dict) else None
        if state.kind_of(model_id) is ModelKind.GENERATION:
            call.label = model_id  # the label of this request's metrics, whatever else is wrong with it
            state.refuse_early(call, model_id)
        max_n = state.settings.max_n
        p = parse_chat(body, max_n) if chat else parse_completion(body, max_n)
        served = await generator_model(state, request, p.model)
        call.label = served.id
        state.fields.unknown(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, endpoint, strict_fields(state, served))
        tools = parse_tools(body) if chat else None
        if chat:
            if tools.forced:
                if p.grammar is not None:
                    raise bad("response_format", "response_format: not with a tool_choice that forces a call")
                p.grammar = tools.grammar()
            all_ids = [chat_prompt_ids(served, chat_messages(p.prompt), tools, template_kwargs(body))]
            echoes: List[Any] = [None]
        else:
            given = prompts(p)
            all_ids = [prompt_ids(served.text, x) for x in given]
            echoes = [(x if isinstance(x, str) else served.text.decode(x)) if p.echo else None for x in given]
        state.admit(served)
        state.engine.note_keep_alive(served.id, keep_alive_of(body))
        runs = runs_of(p, served, all_ids, state.settings.default_max_tokens if chat else 16, echoes)
        answer = Answer(p.model, chat, served.text.token_str, tools, tool_parser(state, served) if chat else None)
        gen = Generation(state, request, call, served.id, runs)
        if p.stream:
            await gen.start()
            return sse_response(sse_stream(gen, _chunks(gen, answer, p), served.id))
        await gen.whole()
        n_prompt, n_gen = gen.counts(p.n)
        out = answer.whole(runs, usage(n_prompt, n_gen))
        gen.done(p.n)
        return json_response(out)
    except ClientGone:
        return call.gone()
    except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
        return call.failed(to_openai(exc, engine_field_names(body, chat)))
    finally:
        call.arrived()  # however it ended (a cancelled task too), it no longer counts as arriving


@router.post("/v1/completions", dependencies=[Depends(api_key("completions"))])
async def completions(request: Request, state: ServerState = Depends(served_state)):
    return await _complete(request, state, "completions", chat=False)


@router.post("/v1/chat/completions", dependencies=[Depends(api_key("chat"))])
async def chat_completions(request: Request, state: ServerState = Depends(served_state)):
    return await _complete(request, state, "chat", chat=True)


@router.get("/v1/models", dependencies=[Depends(api_key())])
async def models(state: ServerState = Depends(served_state)):
    snap = state.engine.snapshot()
    listed = {**{m.id: m.path for m in state.models.values()}, **state.registry.unloaded()}
    return json_response({"object": "list", "data": [model_object(state, m, p, snap) for m, p in listed.items()]})


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(api_key())])
async def model_info(model_id: str, state: ServerState = Depends(served_state)):
    path = state.registry.unloaded().get(model_id) or state.model(model_id).path
    return json_response(model_object(state, model_id, path, state.engine.snapshot()))


@router.post("/v1/embeddings", dependencies=[Depends(api_key("embeddings"))])
async def embeddings(request: Request, state: ServerState = Depends(served_state)):
    call = Call(state, "embeddings")
    try:
        body = await read_json(request)
        model_id = model_field(body)
        state.refuse_early(call, model_id)
        m = await state.resolve(request, model_id)
        if m.kind is ModelKind.GENERATION:
            raise bad("model", f"model {model_id!r} is a text-generation model and serves no embeddings")
        call.label = model_id
        if m.kind is not ModelKind.EMBEDDING:
            raise bad("model", f"model {model_id!r} is a {m.kind} model and serves no embeddings (serve its "
                               f"checkpoint with task: embedding); use /v2/models/{model_id}/infer")
        state.fields.unknown(body, EMBEDDING_FIELDS, "embeddings", strict_fields(state, m))
        rows, fmt = parse_embeddings(m.understanding, body)
        state.admit(m)
        call.arrived()  # its rows reach the engine as the next thing this loop runs
        answers = await state.submit_rows(request, model_id, rows)
    except ClientGone:
        return call.gone()
    except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
        return call.failed(to_openai(exc, {"input_ids": "input", "text": "input", None: "input"}))
    finally:
        call.arrived()
    n = sum(a["tokens"] for a in answers)
    e2e = call.answered(f"{len(rows)} inputs")
    state.metrics.prompt_tokens(model_id, n)
    state.metrics.observe_e2e(model_id, e2e)
    return json_response({"object": "list", "data": embedding_data([a["embedding"] for a in answers], fmt),
                          "model": model_id, "usage": {"prompt_tokens": n, "total_tokens": n}})
