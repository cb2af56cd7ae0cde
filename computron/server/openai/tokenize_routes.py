"""vLLM's tokenizer routes for text generators (lm-eval, guidellm and others read them):

    POST /tokenize    {model, prompt | messages, add_special_tokens?, add_generation_prompt?, tools?,
                       chat_template_kwargs?}  ->  {tokens, count, max_model_len}
    POST /detokenize  {model, tokens}  ->  {prompt}

``messages`` are rendered by the model's chat template exactly as ``/v1/chat/completions`` renders them
(``add_generation_prompt`` default true); a ``prompt`` is tokenized with the model's special tokens unless
``add_special_tokens`` is false. Unknown fields follow the server's ``FieldPolicy``.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..errors import ClientGone, bad, to_openai
from ..http import json_response, read_json
from ..state import Call, ServerState, api_key, served_state
from .chat import chat_messages, parse_tools, template_kwargs
from .fields import boolean, is_int, model_field
from .model_info import strict_fields
from .routes import generator_model

router = APIRouter()

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools",
                   "chat_template_kwargs", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


@router.post("/tokenize", dependencies=[Depends(api_key("tokenize"))])
async def tokenize(request: Request, state: ServerState = Depends(served_state)) -> Response:
    call = Call(state, "tokenize")
    try:
        body = await read_json(request)
        served = await generator_model(state, request, model_field(body))
        call.label = served.id
        state.fields.unknown(body, TOKENIZE_FIELDS, "tokenize", strict_fields(state, served))
        text = served.text
        if ("prompt" in body) == ("messages" in body):
            raise bad("prompt", "prompt or messages: give exactly one")
        if "messages" in body:
            kw = template_kwargs(body)
            kw.setdefault("add_generation_prompt", boolean(body, "add_generation_prompt", True))
            tools = parse_tools(body)
            ids = text.chat_ids(chat_messages(body["messages"]), tools.template_tools(), kw)
        else:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise bad("prompt", "prompt: must be a string")
            ids = text.encode(prompt, add_special_tokens=boolean(body, "add_special_tokens", True))
        out = {"tokens": ids, "count": len(ids), "max_model_len": served.max_positions}
        if boolean(body, "return_token_strs"):
            out["token_strs"] = [text.token_str(t) for t in ids]
    except ClientGone:
        return call.gone()
    except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
        return call.failed(to_openai(exc))
    call.answered(f"{len(ids)} tokens")
    return json_response(out)


@router.post("/detokenize", dependencies=[Depends(api_key("tokenize"))])
async def detokenize(request: Request, state: ServerState = Depends(served_state)) -> Response:
    call = Call(state, "detokenize")
    try:
        body = await read_json(request)
        served = await generator_model(state, request, model_field(body))
        call.label = served.id
        state.fields.unknown(body, DETOKENIZE_FIELDS, "detokenize", strict_fields(state, served))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(is_int(t) and t >= 0 for t in tokens):
            raise bad("tokens", "tokens: must be a list of token ids")
        prompt = served.text.decode(tokens)
    except ClientGone:
        return call.gone()
    except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
        return call.failed(to_openai(exc))
    call.answered(f"{len(tokens)} tokens")
    return json_response({"prompt": prompt})
