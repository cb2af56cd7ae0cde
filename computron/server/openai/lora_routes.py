"""vLLM's LoRA adapter routes: serve and drop adapters while serving.

    POST /v1/load_lora_adapter    {"lora_name": str, "lora_path": str, "base"?: str}
    POST /v1/unload_lora_adapter  {"lora_name": str}

A load serves the PEFT LoRA adapter directory ``lora_path`` as model ``lora_name`` on the served causal
LM ``base`` (no ``base``: the one causal LM served, when there is exactly one; else 400 asking for it).
It is the registry's load of the model entry ``{id: lora_name, base, adapter: lora_path}`` (what a YAML
entry or a Triton load with that config does) and answers once every rank holds the adapter. An unload
answers once the adapter's admitted requests have finished and every rank has dropped it; new requests
get 404 at once. Success answers 200 with vLLM's line of text (``Success: LoRA adapter 'x' added
successfully.``). Errors come in OpenAI's shape, ``param`` naming the field: 400 a bad body or an adapter
that does not fit its base (``lora.adapter.AdapterError``'s line, code ``invalid_adapter``), 404 an
unknown base or adapter, 409 a name already served or a change of it under way, 500 a failure on the
workers, 503 while shutting down. The API key guards both when keys are set. vLLM's ``load_inplace`` is
accepted only as false, its ``lora_int_id`` accepted and ignored.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Set

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response

from ...errors import ModelConflictError, UnknownModelError
from ...lora.adapter import AdapterError
from ..errors import APIError, bad, to_openai
from ..http import error_response, read_json
from ..model_entry import _ID
from ..model_kind import ModelKind
from ..state import ServerState, api_key, served_state

router = APIRouter()

_LOAD_FIELDS = {"lora_name", "lora_path", "base", "load_inplace"}
_UNLOAD_FIELDS = {"lora_name", "lora_int_id"}


def _fields(body: Any, known: Set[str]) -> Dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad(unknown[0], f"{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
    return body


def _string(body: Dict[str, Any], field: str, model_id: bool = True, required: bool = True) -> Optional[str]:
    v = body.get(field)
    if v is None and not required:
        return None
    if not isinstance(v, str) or not v:
        raise bad(field, f"{field}: a non-empty string is required")
    if model_id and not _ID.match(v):
        raise bad(field, f"{field}={v!r}: must be a model id (letters, digits and ._:/-)")
    return v


def _only_base(state: ServerState) -> str:
    """The base of a load that names none: the one causal LM served."""
    lms = [m.id for m in state.models.values() if m.kind is ModelKind.GENERATION and m.base is None]
    if len(lms) == 1:
        return lms[0]
    served = f"causal LMs served: {', '.join(lms)}" if lms else "no causal LM is served"
    raise bad("base", f"base: name the served model the adapter runs on ({served})")


def _answer(exc: Exception, params: Dict[type, str]) -> Response:
    """``exc`` in OpenAI's shape, ``param`` naming the body's field at fault."""
    err = to_openai(exc)
    field = next((p for cls, p in params.items() if isinstance(exc, cls)), None)
    if field is not None:
        err.param = field
    return error_response(err)


@router.post("/v1/load_lora_adapter", dependencies=[Depends(api_key())])
async def load_lora_adapter(request: Request, state: ServerState = Depends(served_state)):
    try:
        body = _fields(await read_json(request), _LOAD_FIELDS)
        name, path = _string(body, "lora_name"), _string(body, "lora_path", model_id=False)
        base = _string(body, "base", required=False) or _only_base(state)
        if body.get("load_inplace") not in (None, False):
            raise bad("load_inplace", "load_inplace: only false is supported: unload the adapter, then load it")
        if state.registry.can_load(name):
            raise ModelConflictError(f"model {name!r} is already served (or being changed): unload it first, or "
                                     "pick another lora_name")
        state.check_serving()
        await state.registry.load(name, {"base": base, "adapter": path}, where="load_lora_adapter")
    except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
        return _answer(exc, {AdapterError: "lora_path", UnknownModelError: "base", ModelConflictError: "lora_name"})
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", dependencies=[Depends(api_key())])
async def unload_lora_adapter(request: Request, state: ServerState = Depends(served_state)):
    try:
        name = _string(_fields(await read_json(request), _UNLOAD_FIELDS), "lora_name")
        m = state.models.get(name)
        if m is not None and m.base is None:
            raise bad("lora_name", f"model {name!r} is not a LoRA adapter: unload models through "
                                   f"POST /v2/repository/models/{name}/unload")
        if m is None and not state.registry.can_load(name):
            adapters = sorted(a for a, x in state.models.items() if x.base is not None)
            raise APIError(404, f"LoRA adapter {name!r} is not served (adapters served: {adapters})",
                           "invalid_request_error", "lora_name", "model_not_found")
        state.check_serving()
        await state.registry.unload(name)
    except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
        return _answer(exc, {UnknownModelError: "lora_name", ModelConflictError: "lora_name"})
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
