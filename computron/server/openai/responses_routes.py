"""``POST /v1/responses``: OpenAI's Responses API on the chat path (``responses.py`` shapes the request and
the answer): the input rendered by the model's chat template with its tools, one engine sequence, its text
read for tool calls by the model's parser. ``stream: true`` answers the Responses events (``event:`` and
``data:`` lines); an error before the first token gets its status code, one after it an error event."""
from __future__ import annotations

from typing import Any, AsyncIterator, Dict

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..errors import ClientGone, bad, to_openai
from ..http import dumps, json_response, read_json, sse_response
from ..state import Call, ServerState, api_key, served_state
from .model_info import strict_fields, tool_parser
from .responses import RESPONSES_FIELDS, ResponseBuilder, parse_responses
from .routes import chat_prompt_ids, generator_model, runs_of, sse_stream
from .runner import Generation

router = APIRouter()

_PARAMS = {"input_ids": "input", "max_tokens": "max_output_tokens", "grammar": "text.format"}


def _event(e: Dict[str, Any]) -> bytes:
    return b"event: " + e["type"].encode() + b"\ndata: " + dumps(e).encode() + b"\n\n"


async def _events(gen: Generation, rb: ResponseBuilder) -> AsyncIterator[bytes]:
    for e in rb.start():
        yield _event(e)
    async for run, kind, piece in gen.events():
        for e in (rb.finish(run, piece.text) if kind == "end" else rb.feed(piece.text)):
            yield _event(e)
    gen.done(1)


@router.post("/v1/responses", dependencies=[Depends(api_key("responses"))])
async def responses(request: Request, state: ServerState = Depends(served_state)) -> Response:
    call, body = Call(state, "responses"), None
    try:
        body = await read_json(request)
        state.refuse_early(call, body.get("model") if isinstance(body, dict) else None)
        p, messages, tools = parse_responses(body)
        served = await generator_model(state, request, p.model)
        call.label = served.id
        state.fields.unknown(body, RESPONSES_FIELDS, "responses", strict_fields(state, served))
        if tools.forced:
            if p.grammar is not None:
                raise bad("text.format", "text.format: not with a tool_choice that forces a call")
            p.grammar = tools.grammar()
        ids = chat_prompt_ids(served, messages, tools, {})
        state.admit(served)
        runs = runs_of(p, served, [ids], state.settings.default_max_tokens, [None])
        rb = ResponseBuilder(p, body, tools, tool_parser(state, served), served.text.token_str)
        gen = Generation(state, request, call, served.id, runs)
        if p.stream:
            await gen.start()
            return sse_response(sse_stream(gen, _events(gen, rb), served.id))
        await gen.whole()
        out = rb.whole(runs[0])
        gen.done(1)
        return json_response(out)
    except ClientGone:
        return call.gone()
    except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
        names = dict(_PARAMS)
        if isinstance(body, dict) and body.get("tool_choice") not in (None, "auto", "none") and not (
                isinstance(body.get("text"), dict) and body["text"].get("format")):
            names["grammar"] = "tool_choice"
        return call.failed(to_openai(exc, names))
    finally:
        call.arrived()
